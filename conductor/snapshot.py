"""Building the ``ClusterSnapshot`` a policy decides on: a pure function of the registry view,
the index matches for the request's keys, this Conductor's pending overlay, the workers'
paces and the time. Each worker's view, and the rules that merge its heartbeat with the
overlay: ``conductor.worker_views``. A ``ViewMemo`` makes the next snapshot from the last one,
remaking only the views whose inputs changed; the snapshot is the same with or without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from clusterstate.workers import WorkerRole
from conductor.pending import PendingView
from conductor.routing import ClusterSnapshot, WorkerView
from conductor.speed import Pace
from conductor.worker_views import RegistryEntry, decode_view, jobs_template, prefill_view, timed_view
from kvstore.index import MatchSnapshot

_NO_PACE = Pace()


class ViewMemo:
    """The view last made of each worker, with what it was made from: the same objects (the
    registration, the heartbeat's load, the pending overlay's frozen groups, which it replaces
    only when they change) and the same values. A worker whose inputs are all unchanged gets
    that view back instead of a new, equal one; views are frozen, so no policy can tell. On a
    large cluster most workers did nothing since the last decision, and this saves most of a
    snapshot's work. One per ``ConductorCore``, used under its lock; holds one entry per worker
    (a worker that left keeps its entry until its id registers again, a few hundred bytes).

    It also keeps the last snapshot's inputs and views, so that the next one, when the
    registry holds the same workers in the same order and the pending view is the same
    overlay's next (``PendingView.overlay``, ``serial``), looks only at the workers that may
    have changed (``_changed_workers``) and copies every other view from the last snapshot."""

    def __init__(self) -> None:
        self.prefill: dict[str, tuple] = {}
        self.decode: dict[str, tuple] = {}
        self.registry: Sequence[RegistryEntry] | None = None  # the last snapshot's inputs
        self.overlay, self.serial = 0, -1  # the last pending view's (PendingView)
        self.paces: Mapping[str, Pace] | None = None
        self.unseen: set[str] = set()  # the registered prefill workers without a pace of their own
        self.matched: frozenset[str] = frozenset()
        self.timed: set[str] = set()  # prefill workers whose view moves with the clock
        self.views: tuple[list[WorkerView], list[WorkerView]] = ([], [])  # the last snapshot's
        self.slots: dict[str, tuple[int, bool, int]] = {}  # id -> registry index, is decode, index in views


def _memo_prefill_view(memo: ViewMemo, entry: RegistryEntry, pending: PendingView, m, pace: Pace,
                       now_s: float) -> WorkerView:
    """``prefill_view``, from what was kept of the last one when nothing it reads but the
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
        template = jobs_template(entry, pending)
        view = prefill_view(entry, pending, m, pace, now_s, template.jobs)
        memo.prefill[w] = (entry.info, load, own, left, records, free_at, usable, tier, pace, template, view)
    if not template.aged and (template.head is None or template.others_run):
        memo.timed.discard(w)
        return view  # no job's elapsed time moves with the clock
    memo.timed.add(w)
    return timed_view(template, view, entry.load_age_s, now_s)


def _memo_decode_view(memo: ViewMemo, entry: RegistryEntry, pending: PendingView) -> WorkerView:
    """``decode_view``, or the same view as last time when its registration, load and overlay
    groups are the same objects (a decode view does not depend on the load's age)."""
    w = entry.info.worker_id
    own, ended, jobs = pending.on_decode.get(w), pending.ended_on_decode.get(w), pending.decode_jobs.get(w)
    hit = memo.decode.get(w)
    if (hit is not None and hit[0] is entry.info and hit[1] is entry.load and hit[2] is own and hit[3] is ended
            and hit[4] is jobs):
        return hit[5]
    view = decode_view(entry, pending)
    memo.decode[w] = (entry.info, entry.load, own, ended, jobs, view)
    return view


def _changed_workers(memo: ViewMemo, registry: Sequence[RegistryEntry], pending: PendingView,
                     matched: frozenset[str], paces: Mapping[str, Pace]) -> set[str] | None:
    """The workers whose views' inputs may differ from those of the last snapshot built with
    ``memo`` (besides the clock, which moves the jobs of ``memo.timed``): a new registration
    or load, a pending group or free moment changed since the last view, a match now or then,
    a new pace (of its own, or the ``unseen`` one of the workers without one). None when that
    is not known, and every worker must be looked at: the registry's workers or order changed,
    the pending view is not the same overlay's next, or a pace was dropped."""
    last = memo.registry
    if (last is None or len(last) != len(registry) or pending.changed is None
            or pending.overlay != memo.overlay or pending.serial != memo.serial + 1):
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
        if old_paces is None or not old_paces.keys() <= paces.keys():
            return None
        get = old_paces.get
        for w, pace in paces.items():
            was = get(w)
            if was is not pace and was != pace:
                changed.add(w)  # a new pace, or a worker's first
        if memo.unseen:
            unseen = {w for w in memo.unseen if w not in paces}
            if unseen and _unseen_pace(paces) != _unseen_pace(old_paces):
                changed |= unseen  # the pooled pace moves with every sample
            memo.unseen = unseen
    return changed


def _unseen_pace(paces: Mapping[str, Pace]) -> Pace:
    """The pace of a worker not in ``paces`` (``Paces.unseen``; ``Pace()`` in a plain mapping)."""
    return getattr(paces, "unseen", _NO_PACE)


def _all_views(registry: Sequence[RegistryEntry], pending: PendingView, match_of, pace_of,
               now_s: float) -> tuple[list[WorkerView], list[WorkerView]]:
    prefill, decode, decode_role = [], [], WorkerRole.DECODE
    for entry in registry:
        w = entry.info.worker_id
        if entry.info.role is decode_role:
            decode.append(decode_view(entry, pending))
        else:
            prefill.append(prefill_view(entry, pending, match_of(w), pace_of(w), now_s))
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
            prefill[k] = timed_view(hit[9], hit[10], registry[i].load_age_s, now_s)
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
        memo.unseen = {w for w, (_, is_decode, _) in slots.items() if not is_decode and w not in paces}
    memo.registry, memo.matched, memo.paces = tuple(registry), matched, paces  # (a list may change after)
    memo.overlay, memo.serial = pending.overlay, pending.serial
    memo.views = (prefill, decode)
    return prefill, decode


def build_snapshot(registry: Sequence[RegistryEntry], matches: MatchSnapshot | None, pending: PendingView,
                   now_s: float, prefix_rate_per_s: float = 0.0,
                   paces: Mapping[str, Pace] | None = None, memo: ViewMemo | None = None) -> ClusterSnapshot:
    """The snapshot for one request (``matches``: the index's answer for its keys, or None;
    ``paces``: each prefill worker's pace lately, ``conductor.speed``; a worker not in it has
    its ``unseen`` pace (``Paces``), or ``Pace()`` (a plain mapping, or none);
    ``memo``: the views of the last snapshot built with it, reused where nothing changed, see
    ``ViewMemo``; the snapshot is the same with or without). A ``paces`` is never changed once
    passed (a new one per change, as ``WorkerSpeed``'s): the memo tells them apart by identity."""
    paces = paces or {}
    get_pace = paces.get

    def pace_of(worker_id: str) -> Pace:
        return get_pace(worker_id) or _unseen_pace(paces)

    # A match with no usable block reads as none (most workers of a large cluster): only the
    # workers that hold a block (``held``) can have one.
    by_worker = {m.worker_id: m for m in matches.held if m.num_blocks_usable} if matches is not None else {}
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


__all__ = ["RegistryEntry", "ViewMemo", "build_snapshot"]
