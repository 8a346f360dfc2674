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
from typing import NamedTuple

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


class JobsTemplate(NamedTuple):
    """A prefill worker's jobs as the snapshot sees them, less the clock: what its heartbeat
    lists (less what this Conductor saw leave) and then this Conductor's jobs it does not list.
    ``aged``: the listed running jobs, whose elapsed time grows by the heartbeat's age; ``head``:
    the job made running by ``_running_head`` when nothing else runs, from ``start_s``
    (None: none). Made when the worker's inputs change, read on every decision (``_timed_jobs``)."""

    jobs: tuple[PrefillJobLoad, ...]
    aged: tuple[int, ...]
    head: int | None
    start_s: float
    others_run: bool  # a job outside ``aged`` runs: no head is made running


def _jobs_template(entry: RegistryEntry, pending: PendingView) -> JobsTemplate:
    w = entry.worker_id
    own = pending.prefill_jobs.get(w, ())
    if not entry.load.prefill_jobs:
        jobs, aged = own, ()  # the heartbeat lists nothing: every job is ours
    else:
        left = pending.left_prefill.get(w, frozenset())
        kept = [j for j in entry.load.prefill_jobs if request_of(j.request_id) not in left]
        aged = tuple(i for i, j in enumerate(kept) if j.elapsed_s != 0)  # a queued job is listed as it is
        if own:
            listed = {request_of(j.request_id) for j in entry.load.prefill_jobs}
            kept += [j for j in own if j.request_id not in listed]
        jobs = tuple(kept)
    others_run = any(j.elapsed_s > 0 for i, j in enumerate(jobs) if i not in aged)
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


def _timed_jobs(template: JobsTemplate, age_s: float, now_s: float) -> tuple[PrefillJobLoad, ...]:
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
    return _timed_jobs(_jobs_template(entry, pending), entry.load_age_s, now_s)


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
    (a worker that left keeps its entry until its id registers again, a few hundred bytes).

    It also keeps the last snapshot's inputs and views, so that the next one, when the
    registry holds the same workers in the same order and the pending view is the overlay's
    next (``PendingView.serial``), looks only at the workers that may have changed
    (``_changed_workers``) and copies every other view from the last snapshot."""

    def __init__(self) -> None:
        self.prefill: dict[str, tuple] = {}
        self.decode: dict[str, tuple] = {}
        self.registry: Sequence[RegistryEntry] | None = None  # the last snapshot's inputs
        self.serial = -1
        self.paces: Mapping[str, Pace] | None = None
        self.all_seen = False  # every prefill worker then had a pace of its own
        self.matched: frozenset[str] = frozenset()
        self.timed: set[str] = set()  # prefill workers whose view moves with the clock
        self.views: tuple[list[WorkerView], list[WorkerView]] = ([], [])  # the last snapshot's
        self.slots: dict[str, tuple[int, bool, int]] = {}  # id -> registry index, is decode, index in views


def _prefill_view(entry: RegistryEntry, pending: PendingView, m, pace: Pace, now_s: float,
                  jobs: tuple[PrefillJobLoad, ...] | None = None) -> WorkerView:
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


def _memo_prefill_view(memo: ViewMemo, entry: RegistryEntry, pending: PendingView, m, pace: Pace,
                       now_s: float) -> WorkerView:
    """``_prefill_view``, from what was kept of the last one when nothing it reads but the
    clock has changed: the registration and load (the same objects), this Conductor's jobs
    there, the requests that left it and the one it runs first (the overlay's groups), when
    that one started, the matched prefix (usable blocks, slowest tier) and the pace. Then the
    jobs' template (``JobsTemplate``) is kept, and with no job whose elapsed time moves with
    the clock so is the view itself; otherwise only the jobs are timed and the view copied."""
    w, load = entry.info.worker_id, entry.load
    usable = m.num_blocks_usable if m is not None else 0
    tier = m.slowest_usable_tier if usable else None
    own, records = pending.prefill_jobs.get(w), pending.in_prefill.get(w)
    left = pending.left_prefill.get(w) if load.prefill_jobs else None
    free_at = pending.prefill_free_at_s.get(w) if records else None
    hit = memo.prefill.get(w)
    if (hit is not None and hit[0] is entry.info and hit[1] is load and hit[2] is own and hit[3] is left
            and hit[4] is records and hit[5] == free_at and hit[6] == usable and hit[7] is tier
            and (hit[8] is pace or hit[8] == pace)):
        template, view = hit[9], hit[10]
    else:
        template = _jobs_template(entry, pending)
        view = _prefill_view(entry, pending, m, pace, now_s, template.jobs)
        memo.prefill[w] = (entry.info, load, own, left, records, free_at, usable, tier, pace, template, view)
    if not template.aged and (template.head is None or template.others_run):
        memo.timed.discard(w)
        return view  # no job's elapsed time moves with the clock
    memo.timed.add(w)
    return _timed_view(template, view, entry.load_age_s, now_s)


def _timed_view(template: JobsTemplate, view: WorkerView, age_s: float, now_s: float) -> WorkerView:
    """``view`` (made with ``template``'s jobs) with its jobs timed at ``now_s``."""
    jobs = _timed_jobs(template, age_s, now_s)
    if jobs is template.jobs:
        return view
    timed = object.__new__(WorkerView)
    timed.__dict__.update(view.__dict__, prefill_jobs=jobs)
    return timed


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


def _changed_workers(memo: ViewMemo, registry: Sequence[RegistryEntry], pending: PendingView,
                     matched: frozenset[str], paces: Mapping[str, Pace]) -> set[str] | None:
    """The workers whose views' inputs may differ from those of the last snapshot built with
    ``memo`` (besides the clock, which moves the jobs of ``memo.timed``): a new registration
    or load, a pending group or free moment changed since the last view, a match now or then,
    a new pace. None when that is not known, and
    every worker must be looked at: the registry's workers or order changed, the pending view
    is not the overlay's next, a pace was dropped, or one applies to workers not seen yet."""
    last = memo.registry
    if (last is None or len(last) != len(registry) or pending.changed is None
            or pending.serial != memo.serial + 1):
        return None
    changed = set(pending.changed)
    changed |= matched
    changed |= memo.matched
    for new, old in zip(registry, last, strict=True):
        if new is not old and (new.info is not old.info or new.load is not old.load):
            if new.info.worker_id != old.info.worker_id:
                return None
            changed.add(new.info.worker_id)
    old_paces = memo.paces
    if paces is not old_paces:
        if not memo.all_seen or old_paces is None or not old_paces.keys() <= paces.keys():
            return None  # a worker's pace may be the ``unseen`` one, which moves with every sample
        get = old_paces.get
        for w, pace in paces.items():
            was = get(w)
            if was is not pace and was != pace:
                changed.add(w)
    return changed


def _all_views(registry: Sequence[RegistryEntry], pending: PendingView, match_of, pace_of,
               now_s: float) -> tuple[list[WorkerView], list[WorkerView]]:
    prefill, decode, decode_role = [], [], WorkerRole.DECODE
    for entry in registry:
        w = entry.info.worker_id
        if entry.info.role is decode_role:
            decode.append(_decode_view(entry, pending))
        else:
            prefill.append(_prefill_view(entry, pending, match_of(w), pace_of(w), now_s))
    return prefill, decode


def _memo_views(memo: ViewMemo, registry: Sequence[RegistryEntry], pending: PendingView, by_worker: dict,
                paces: Mapping[str, Pace], pace_of, now_s: float) -> tuple[list[WorkerView], list[WorkerView]]:
    """``_all_views``, from ``memo``: the last snapshot's views, with those of the workers that
    changed made again (``_memo_*_view``) and the timed ones timed; or, when what changed is
    not known, every worker's view through the memo."""
    matched, match_of = frozenset(by_worker), by_worker.get
    changed = _changed_workers(memo, registry, pending, matched, paces)
    if changed is not None:
        prefill, decode = list(memo.views[0]), list(memo.views[1])
        slots, kept = memo.slots, memo.prefill
        for w in memo.timed.difference(changed):  # only the clock moved: the kept template, timed
            i, _, k = slots[w]
            hit = kept[w]
            prefill[k] = _timed_view(hit[9], hit[10], registry[i].load_age_s, now_s)
        for w in changed:
            slot = slots.get(w)
            if slot is None:
                continue  # not registered: no view
            i, is_decode, k = slot
            if is_decode:
                decode[k] = _memo_decode_view(memo, registry[i], pending)
            else:
                prefill[k] = _memo_prefill_view(memo, registry[i], pending, match_of(w), pace_of(w), now_s)
    else:
        prefill, decode, decode_role, slots = [], [], WorkerRole.DECODE, {}
        memo.timed.clear()  # made again below, of the workers registered now
        for i, entry in enumerate(registry):
            w = entry.info.worker_id
            if entry.info.role is decode_role:
                slots[w] = (i, True, len(decode))
                decode.append(_memo_decode_view(memo, entry, pending))
            else:
                slots[w] = (i, False, len(prefill))
                prefill.append(_memo_prefill_view(memo, entry, pending, match_of(w), pace_of(w), now_s))
        memo.slots = slots
        memo.all_seen = all(w in paces for w, (_, is_decode, _) in slots.items() if not is_decode)
    memo.registry, memo.serial, memo.matched, memo.paces = registry, pending.serial, matched, paces
    memo.views = (prefill, decode)
    return prefill, decode


def build_snapshot(registry: Sequence[RegistryEntry], matches: MatchSnapshot | None, pending: PendingView,
                   now_s: float, prefix_rate_per_s: float = 0.0,
                   paces: Mapping[str, Pace] | None = None, memo: ViewMemo | None = None) -> ClusterSnapshot:
    """The snapshot for one request (``matches``: the index's answer for its keys, or None;
    ``paces``: each prefill worker's pace lately, ``conductor.speed``; a worker not in it has
    its ``unseen`` pace (``Paces``), or ``Pace()`` (a plain mapping, or none);
    ``memo``: the views of the last snapshot built with it, reused where nothing changed, see
    ``ViewMemo``; the snapshot is the same with or without)."""
    paces = paces or {}
    get_pace = paces.get

    def pace_of(worker_id: str) -> Pace:
        return get_pace(worker_id) or getattr(paces, "unseen", _NO_PACE)

    # A match with no usable block reads as none (most workers of a large cluster).
    by_worker = {m.worker_id: m for m in matches.matches if m.num_blocks_usable} if matches is not None else {}
    if memo is None:
        prefill, decode = _all_views(registry, pending, by_worker.get, pace_of, now_s)
    else:
        prefill, decode = _memo_views(memo, registry, pending, by_worker, paces, pace_of, now_s)
    # Made without ClusterSnapshot's checks (two passes over every worker, per decision): each
    # view's role is set above from the registry's, whose worker ids are unique.
    snapshot = object.__new__(ClusterSnapshot)
    snapshot.__dict__.update(prefill=tuple(prefill), decode=tuple(decode), time_s=now_s,
                             prefix_rate_per_s=prefix_rate_per_s)
    return snapshot
