"""Building the ``ClusterSnapshot`` a policy decides on: a pure function of the registry view,
the index matches for the request's keys, this Conductor's pending overlay and the time.

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
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from clusterstate.workers import PrefillJobLoad, WorkerInfo, WorkerLoad, WorkerRole
from conductor.decode_batch import DecodeJobs
from conductor.dispatch import request_of
from conductor.pending import PendingView
from conductor.routing import ClusterSnapshot, WorkerView
from conductor.speed import Pace
from kvstore.index import MatchSnapshot

_NO_PACE = Pace()
_NO_DECODE_JOBS = DecodeJobs()
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


def _prefill_jobs(entry: RegistryEntry, pending: PendingView, now_s: float) -> tuple[PrefillJobLoad, ...]:
    w = entry.worker_id
    own = pending.prefill_jobs.get(w, ())
    if not entry.load.prefill_jobs:
        return _with_head_running(own, w, pending, now_s)  # the heartbeat lists nothing: every job is ours
    left = pending.left_prefill.get(w, frozenset())
    age_s = entry.load_age_s
    # A queued job (elapsed 0) is listed as it is; a running one has run for the load's age more.
    jobs = [j if j.elapsed_s == 0 else PrefillJobLoad(j.request_id, j.num_new_tokens, j.num_reused_tokens,
                                                      j.elapsed_s + age_s if j.elapsed_s > 0 else 0.0)
            for j in entry.load.prefill_jobs if request_of(j.request_id) not in left]
    if own:
        listed = {request_of(j.request_id) for j in entry.load.prefill_jobs}
        jobs += [j for j in own if j.request_id not in listed]
    return _with_head_running(tuple(jobs), w, pending, now_s)


def _with_head_running(jobs: tuple[PrefillJobLoad, ...], worker_id: str, pending: PendingView,
                       now_s: float) -> tuple[PrefillJobLoad, ...]:
    """``jobs`` with the one running, when none is known to run: the worker runs its prefills
    one at a time and starts the next when one ends, so of this Conductor's jobs there the one
    routed first has run since it was routed or since the last prefill this Conductor saw end
    there, whichever is later. Without it a job that is half done would count in full in the
    next request's queue (a heartbeat lists it as running only every interval)."""
    records = pending.in_prefill.get(worker_id)
    if not records or not jobs or any(j.elapsed_s > 0 for j in jobs):
        return jobs  # (none: a retry routed back here while the heartbeat lists the placement that left)
    first = records[0]  # the overlay keeps a worker's jobs in routing order
    elapsed_s = now_s - max(first.routed_at_s, pending.prefill_free_at_s.get(worker_id, first.routed_at_s))
    if elapsed_s <= 0:
        return jobs
    head = 0 if jobs[0].request_id == first.request_id else next(
        (i for i, j in enumerate(jobs) if request_of(j.request_id) == first.request_id), None)
    if head is None:  # a retry whose earlier placement the heartbeat still lists
        return jobs
    j = jobs[head]
    return (*jobs[:head], PrefillJobLoad(j.request_id, j.num_new_tokens, j.num_reused_tokens, elapsed_s),
            *jobs[head + 1:])


@functools.lru_cache(maxsize=256)
def _requests_of(placement_ids: tuple[str, ...]) -> frozenset[str]:
    """The requests a heartbeat lists (cached: a heartbeat's list is read by every decision
    until the next one, and hashing the tuple is far cheaper than parsing its ids)."""
    return frozenset(map(request_of, placement_ids))


def _decode_view(entry: RegistryEntry, pending: PendingView) -> WorkerView:
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


class ViewMemo:
    """The view last made of each worker, with what it was made from: the same objects (the
    registration, the heartbeat's load, the pending overlay's frozen groups, which it replaces
    only when they change) and the same values. A worker whose inputs are all unchanged gets
    that view back instead of a new, equal one; views are frozen, so no policy can tell. On a
    large cluster most workers did nothing since the last decision, and this saves most of a
    snapshot's work. One per ``ConductorCore``, used under its lock; holds one entry per worker
    (a worker that left keeps its entry until its id registers again, a few hundred bytes)."""

    def __init__(self) -> None:
        self.prefill: dict[str, tuple] = {}
        self.decode: dict[str, tuple] = {}


def _prefill_view(entry: RegistryEntry, pending: PendingView, m, pace: Pace, now_s: float) -> WorkerView:
    usable = m.num_blocks_usable if m is not None else 0
    info, load = entry.info, entry.load
    return _view(
        worker_id=info.worker_id, role=WorkerRole.PREFILL, rpc_address=info.rpc_address,
        transfer_address=info.transfer_address, num_free_pages=load.num_free_pages,
        num_running=load.num_running, prefill_jobs=_prefill_jobs(entry, pending, now_s), usable_blocks=usable,
        usable_tier=m.slowest_usable_tier if usable else None, slowdown=pace.slowdown,
        handoff_s=pace.handoff_s, dispatch_s=pace.dispatch_s,
        cpp_stages=info.cpp_stages, cpp_chunk_tokens=info.cpp_chunk_tokens,
    )


def _memo_prefill_view(memo: ViewMemo, entry: RegistryEntry, pending: PendingView, m, pace: Pace,
                       now_s: float) -> WorkerView:
    """``_prefill_view``, or the same view as last time when nothing it reads has changed: the
    registration and load (the same objects), the load's age (only read when the heartbeat
    lists jobs), this Conductor's jobs there and the requests that left it (the overlay's
    groups), the matched prefix (usable blocks, slowest tier) and the pace. A worker that holds
    jobs this Conductor routed is made anew: its head job's elapsed time moves with the clock
    (``_with_head_running``)."""
    w, load = entry.info.worker_id, entry.load
    if pending.in_prefill.get(w):
        return _prefill_view(entry, pending, m, pace, now_s)
    usable = m.num_blocks_usable if m is not None else 0
    tier = m.slowest_usable_tier if usable else None
    listed = bool(load.prefill_jobs)
    age = entry.load_age_s if listed else None
    own, left = pending.prefill_jobs.get(w), pending.left_prefill.get(w) if listed else None
    hit = memo.prefill.get(w)
    if (hit is not None and hit[0] is entry.info and hit[1] is load and hit[2] == age and hit[3] is own
            and hit[4] is left and hit[5] == usable and hit[6] is tier and (hit[7] is pace or hit[7] == pace)):
        return hit[8]
    view = _prefill_view(entry, pending, m, pace, now_s)
    memo.prefill[w] = (entry.info, load, age, own, left, usable, tier, pace, view)
    return view


def _memo_decode_view(memo: ViewMemo, entry: RegistryEntry, pending: PendingView) -> WorkerView:
    """``_decode_view``, or the same view as last time when its registration, load and overlay
    groups are the same objects (a decode view does not depend on the load's age)."""
    w = entry.info.worker_id
    own, ended, jobs = pending.on_decode.get(w), pending.ended_on_decode.get(w), pending.decode_jobs.get(w)
    hit = memo.decode.get(w)
    if (hit is not None and hit[0] is entry.info and hit[1] is entry.load and hit[2] is own and hit[3] is ended
            and hit[4] is jobs):
        return hit[5]
    view = _decode_view(entry, pending)
    memo.decode[w] = (entry.info, entry.load, own, ended, jobs, view)
    return view


def build_snapshot(registry: Sequence[RegistryEntry], matches: MatchSnapshot | None, pending: PendingView,
                   now_s: float, prefix_rate_per_s: float = 0.0,
                   paces: Mapping[str, Pace] | None = None, memo: ViewMemo | None = None) -> ClusterSnapshot:
    """The snapshot for one request (``matches``: the index's answer for its keys, or None;
    ``paces``: each prefill worker's pace lately, ``conductor.speed``; a worker not in it has
    its ``unseen`` pace (``Paces``), or ``Pace()`` (a plain mapping, or none);
    ``memo``: the views of the last snapshot built with it, reused where nothing changed, see
    ``ViewMemo``; the snapshot is the same with or without)."""
    paces = paces or {}

    def unseen() -> Pace:
        return getattr(paces, "unseen", _NO_PACE)

    # A match with no usable block reads as none (most workers of a large cluster).
    by_worker = {m.worker_id: m for m in matches.matches if m.num_blocks_usable} if matches is not None else {}
    prefill, decode = [], []
    decode_role, match_of, pace_of = WorkerRole.DECODE, by_worker.get, paces.get  # once, not per worker
    for entry in registry:
        info = entry.info
        w = info.worker_id
        if info.role is decode_role:
            decode.append(_decode_view(entry, pending) if memo is None else _memo_decode_view(memo, entry, pending))
        elif memo is None:
            prefill.append(_prefill_view(entry, pending, match_of(w), pace_of(w) or unseen(), now_s))
        else:
            prefill.append(_memo_prefill_view(memo, entry, pending, match_of(w), pace_of(w) or unseen(), now_s))
    # Made without ClusterSnapshot's checks (two passes over every worker, per decision): each
    # view's role is set above from the registry's, whose worker ids are unique.
    snapshot = object.__new__(ClusterSnapshot)
    snapshot.__dict__.update(prefill=tuple(prefill), decode=tuple(decode), time_s=now_s,
                             prefix_rate_per_s=prefix_rate_per_s)
    return snapshot
