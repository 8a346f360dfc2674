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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from conductor.dispatch import request_of
from conductor.pending import PendingView
from conductor.routing import ClusterSnapshot, WorkerView
from kvstore.index import MatchSnapshot, PrefillJobLoad, WorkerLoad, WorkerRole


@dataclass(frozen=True)
class RegistryEntry:
    """One alive worker in the registry, with its latest load and how old that load is."""

    worker_id: str
    role: WorkerRole
    rpc_address: str
    transfer_address: str
    load: WorkerLoad
    load_age_s: float = 0.0


def _prefill_jobs(entry: RegistryEntry, pending: PendingView) -> tuple[PrefillJobLoad, ...]:
    w = entry.worker_id
    left = pending.left_prefill.get(w, frozenset())
    jobs = [PrefillJobLoad(j.request_id, j.num_new_tokens, j.num_reused_tokens,
                           j.elapsed_s + entry.load_age_s if j.elapsed_s > 0 else 0.0)
            for j in entry.load.prefill_jobs if request_of(j.request_id) not in left]
    own = pending.in_prefill.get(w, ())
    if own:
        listed = {request_of(j.request_id) for j in entry.load.prefill_jobs}
        jobs += [PrefillJobLoad(r.request_id, r.num_new_tokens, r.num_reused_tokens)
                 for r in own if r.request_id not in listed]
    return tuple(jobs)


def _decode_view(entry: RegistryEntry, pending: PendingView) -> WorkerView:
    w, load = entry.worker_id, entry.load
    listed = {request_of(r) for r in load.request_ids}
    own = pending.on_decode.get(w, ())
    own_ids = {r.request_id for r in own}
    free, queued, running, context = load.num_free_pages, load.num_queued, load.num_running, load.num_context_tokens
    for r in own:
        if r.request_id not in listed:
            free -= r.num_pages
            queued += 1
    for r in pending.ended_on_decode.get(w, ()):
        if r.request_id in listed and r.request_id not in own_ids:
            free += r.num_pages
            if r.decoding:
                running -= 1
                context -= r.num_prompt_tokens + r.num_generated
            else:
                queued -= 1
    return WorkerView(
        w, WorkerRole.DECODE, entry.rpc_address, entry.transfer_address, num_free_pages=max(0, free),
        num_running=max(0, running), num_queued=max(0, queued), num_context_tokens=max(0, context),
        decode_jobs=pending.decode_jobs.get(w, ()),
    )


def build_snapshot(registry: Sequence[RegistryEntry], matches: MatchSnapshot | None, pending: PendingView,
                   now_s: float, prefix_rate_per_s: float = 0.0,
                   slowdown: Mapping[str, float] | None = None) -> ClusterSnapshot:
    """The snapshot for one request (``matches``: the index's answer for its keys, or None;
    ``slowdown``: each prefill worker's observed/predicted prefill time, default 1)."""
    slowdown = slowdown or {}
    prefill, decode = [], []
    for entry in registry:
        if entry.role is WorkerRole.DECODE:
            decode.append(_decode_view(entry, pending))
            continue
        m = matches.get(entry.worker_id) if matches is not None else None
        usable = m.num_blocks_usable if m is not None else 0
        prefill.append(WorkerView(
            entry.worker_id, WorkerRole.PREFILL, entry.rpc_address, entry.transfer_address,
            num_free_pages=entry.load.num_free_pages, num_running=entry.load.num_running,
            prefill_jobs=_prefill_jobs(entry, pending), usable_blocks=usable,
            usable_tier=m.slowest_usable_tier if usable else None, slowdown=slowdown.get(entry.worker_id, 1.0),
        ))
    return ClusterSnapshot(tuple(prefill), tuple(decode), now_s, prefix_rate_per_s)
