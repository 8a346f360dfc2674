"""One worker's view in a routing snapshot (``WorkerView``), made from its registry entry
(its registration and last heartbeat), this Conductor's pending overlay, the index's match
for the request and the worker's pace; ``conductor.snapshot`` puts them together.

Per prefill worker, the jobs it holds are its last heartbeat's jobs, less those this
Conductor saw finish (the heartbeat is older), plus those it routed there that the heartbeat
does not list yet; a running job's elapsed time is advanced by the heartbeat's age. Per
decode worker, the free pages and queued/running counts of its heartbeat are corrected the
same way: reservations not yet listed take their pages, finished requests still listed give
theirs back. Exactly one source counts each request, so nothing is double counted::

    heartbeat lists r? | this Conductor knows r as | counted from
    yes                | live or unknown           | the heartbeat
    yes                | finished                  | nowhere (it is gone)
    no                 | live                      | the overlay

Pure functions of their arguments; the views are frozen.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from dataclasses import dataclass
from typing import NamedTuple

from clusterstate.workers import PrefillJobLoad, WorkerInfo, WorkerLoad, WorkerRole
from conductor.decode_batch import DecodeJobs
from conductor.dispatch import request_of
from conductor.pending import PendingView
from conductor.routing import WorkerView
from conductor.speed import Pace

_NO_DECODE_JOBS = DecodeJobs()
_elapsed_s = operator.attrgetter("elapsed_s")
_VIEW_DEFAULTS = {f.name: f.default for f in dataclasses.fields(WorkerView) if f.default is not dataclasses.MISSING}


def _view(**fields: object) -> WorkerView:
    """``WorkerView(**fields)`` without the frozen dataclass's per-field ``__setattr__`` and
    ``__post_init__`` (a snapshot makes one per worker per decision, three times faster this
    way): its counts come from validated loads or are clamped at 0, its role and tier are
    already enums; the assert re-checks the counts."""
    view = object.__new__(WorkerView)
    view.__dict__.update(_VIEW_DEFAULTS, **fields)
    assert min(view.num_free_pages, view.num_running, view.num_queued, view.num_context_tokens,
               view.usable_blocks) >= 0, view
    return view


@dataclass(frozen=True)
class RegistryEntry:
    """One alive worker in the registry, with its latest load and how old that load is."""

    info: WorkerInfo
    load: WorkerLoad
    load_age_s: float = 0.0

    @classmethod
    def of(cls, info: WorkerInfo, load: WorkerLoad, load_age_s: float) -> RegistryEntry:
        """``RegistryEntry(info, load, load_age_s)`` without the frozen dataclass's per-field
        ``__setattr__`` (a registry view makes one per worker per decision)."""
        entry = object.__new__(cls)
        entry.__dict__.update(info=info, load=load, load_age_s=load_age_s)
        return entry

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> WorkerRole:
        return self.info.role

    @property
    def rpc_address(self) -> str:
        return self.info.rpc_address

    @property
    def transfer_address(self) -> str:
        return self.info.transfer_address


class JobsTemplate(NamedTuple):
    """A prefill worker's jobs as the snapshot sees them, less the clock: what its heartbeat
    lists (less what this Conductor saw leave) and then this Conductor's jobs it does not list.
    ``aged``: the listed running jobs, whose elapsed time grows by the heartbeat's age; ``head``:
    the job made running by ``_running_head`` when nothing else runs, from ``start_s``
    (None: none). Made when the worker's inputs change, read on every decision (``timed_jobs``)."""

    jobs: tuple[PrefillJobLoad, ...]
    aged: tuple[int, ...]
    head: int | None
    start_s: float
    others_run: bool  # a job outside ``aged`` runs: no head is made running


def jobs_template(entry: RegistryEntry, pending: PendingView) -> JobsTemplate:
    """The template of ``entry``'s worker. Its passes over the jobs run in C (``compress``,
    ``map``): a busy worker's heartbeat lists its whole queue, and a new one comes every interval."""
    w = entry.worker_id
    own = pending.prefill_jobs.get(w, ())
    listed_jobs = entry.load.prefill_jobs
    if not listed_jobs:
        jobs, aged, ours = own, (), own  # the heartbeat lists nothing: every job is ours
    else:
        left = pending.left_prefill.get(w)
        kept = [j for j in listed_jobs if request_of(j.request_id) not in left] if left else list(listed_jobs)
        # The listed running jobs: the listed jobs whose elapsed time is not 0 (a queued job is
        # listed as it is).
        aged = tuple(itertools.compress(range(len(kept)), map(_elapsed_s, kept)))
        ours = ()
        if own:
            listed = {request_of(j.request_id) for j in listed_jobs}
            ours = [j for j in own if j.request_id not in listed]
            kept += ours
        jobs = tuple(kept)
    # A job outside ``aged`` that runs: only one of ours can be (the listed others' elapsed is 0).
    others_run = max(map(_elapsed_s, ours), default=0.0) > 0
    head, start_s = _running_head(jobs, w, pending)
    return JobsTemplate(jobs, aged, head, start_s, others_run)


def _running_head(jobs: tuple[PrefillJobLoad, ...], worker_id: str, pending: PendingView) -> tuple[int | None, float]:
    """The worker runs its prefills one at a time and starts the next when one ends, so of this
    Conductor's jobs there the one routed first has run since it was routed or since the last
    prefill this Conductor saw end there, whichever is later: its index in ``jobs`` and that
    moment. Without it a job that is half done would count in full in the next request's queue
    (a heartbeat lists it as running only every interval)."""
    records = pending.in_prefill.get(worker_id)
    if not records or not jobs:
        return None, 0.0
    first = records[0]  # the overlay keeps a worker's jobs in routing order
    head = 0 if jobs[0].request_id == first.request_id else next(
        (i for i, j in enumerate(jobs) if request_of(j.request_id) == first.request_id), None)
    # (None: a retry whose earlier placement the heartbeat still lists)
    return head, max(first.routed_at_s, pending.prefill_free_at_s.get(worker_id, first.routed_at_s))


def timed_jobs(template: JobsTemplate, age_s: float, now_s: float) -> tuple[PrefillJobLoad, ...]:
    """The template's jobs at ``now_s`` with a heartbeat ``age_s`` old: a listed running job
    has run for the load's age more; when none runs, the head has run since its start."""
    jobs, aged, head = template.jobs, template.aged, template.head
    if aged:  # listed running jobs (elapsed > 0): they run on, and no head is made running
        jobs = list(jobs)
        for i in aged:
            j = jobs[i]
            jobs[i] = PrefillJobLoad(j.request_id, j.num_new_tokens, j.num_reused_tokens, j.elapsed_s + age_s)
        return tuple(jobs)
    if head is None or template.others_run:
        return jobs
    elapsed_s = now_s - template.start_s
    if elapsed_s <= 0:
        return jobs
    j = jobs[head]
    return (*jobs[:head], PrefillJobLoad(j.request_id, j.num_new_tokens, j.num_reused_tokens, elapsed_s),
            *jobs[head + 1:])


def _prefill_jobs(entry: RegistryEntry, pending: PendingView, now_s: float) -> tuple[PrefillJobLoad, ...]:
    return timed_jobs(jobs_template(entry, pending), entry.load_age_s, now_s)


@functools.lru_cache(maxsize=256)
def _requests_of(placement_ids: tuple[str, ...]) -> frozenset[str]:
    """The requests a heartbeat lists (cached: a heartbeat's list is read by every decision
    until the next one, and hashing the tuple is far cheaper than parsing its ids)."""
    return frozenset(map(request_of, placement_ids))


def decode_view(entry: RegistryEntry, pending: PendingView) -> WorkerView:
    """A decode worker's view: its heartbeat's counts corrected by the overlay (module docstring)."""
    w, load = entry.worker_id, entry.load
    listed = _requests_of(load.request_ids)
    own = pending.on_decode.get(w, ())
    free, queued, running, context = load.num_free_pages, load.num_queued, load.num_running, load.num_context_tokens
    for r in own:
        if r.request_id not in listed:
            free -= r.num_pages
            queued += 1
    ended = pending.ended_on_decode.get(w, {})
    still_listed = [ended[r] for r in listed if r in ended] if listed and ended else []
    own_ids = {r.request_id for r in own} if still_listed else set()
    for r in still_listed:
        if r.request_id not in own_ids:
            free += r.num_pages
            if r.decoding:
                running -= 1
                context -= r.num_prompt_tokens + r.num_generated
            else:
                queued -= 1
    return _view(
        worker_id=w, role=WorkerRole.DECODE, rpc_address=entry.rpc_address, transfer_address=entry.transfer_address,
        num_free_pages=max(0, free), num_running=max(0, running), num_queued=max(0, queued),
        num_context_tokens=max(0, context), decode_jobs=pending.decode_jobs.get(w, _NO_DECODE_JOBS),
    )


def prefill_view(entry: RegistryEntry, pending: PendingView, m, pace: Pace, now_s: float,
                 jobs: tuple[PrefillJobLoad, ...] | None = None) -> WorkerView:
    """A prefill worker's view at ``now_s``: its jobs (``jobs``, already made from its
    ``JobsTemplate``, or made here), its match ``m`` (a ``WorkerMatch``, or None) and its pace."""
    usable = m.num_blocks_usable if m is not None else 0
    info, load = entry.info, entry.load
    return _view(
        worker_id=info.worker_id, role=WorkerRole.PREFILL, rpc_address=info.rpc_address,
        transfer_address=info.transfer_address, num_free_pages=load.num_free_pages, num_running=load.num_running,
        prefill_jobs=_prefill_jobs(entry, pending, now_s) if jobs is None else jobs, usable_blocks=usable,
        usable_tier=m.slowest_usable_tier if usable else None, slowdown=pace.slowdown,
        handoff_s=pace.handoff_s, dispatch_s=pace.dispatch_s,
        cpp_stages=info.cpp_stages, cpp_chunk_tokens=info.cpp_chunk_tokens,
    )


def timed_view(template: JobsTemplate, view: WorkerView, age_s: float, now_s: float) -> WorkerView:
    """``view`` (made with ``template``'s jobs) with its jobs timed at ``now_s``."""
    jobs = timed_jobs(template, age_s, now_s)
    if jobs is template.jobs:
        return view
    timed = object.__new__(WorkerView)
    timed.__dict__.update(view.__dict__, prefill_jobs=jobs)
    return timed
