"""The load- and prefix-based routing policies: ``random``, ``round_robin``,
``least_loaded`` and ``cache_aware`` (SGLang's router).

Each is a pure function of ``(ClusterSnapshot, RouteRequest)`` built by a factory registered
by name in ``conductor.routing``; each first applies the shared admission rules
(``admission_rejection``), then picks one prefill and one fitting decode worker, and leaves
the reuse plan to the shared ``plan_reuse`` (through ``decide``). The orderings below
(``prefill_load_key``, ``least_loaded_decode``) are public so other policies can reuse them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from conductor.routing import (
    ClusterSnapshot,
    Policy,
    PolicyContext,
    Rejection,
    RouteDecision,
    RouteRequest,
    WorkerView,
    admission_rejection,
    capped_usable,
    decide,
    decode_need_pages,
    fitting_decode,
    register_policy,
)

PrefillPicker = Callable[[ClusterSnapshot, RouteRequest], WorkerView]


# --- orderings shared by policies -----------------------------------------------------


def prefill_load_key(worker: WorkerView) -> tuple[int, int, str]:
    """Less is less loaded: prefills held (queued or running), then tokens still to compute."""
    return (worker.queue_len, worker.num_queued_tokens, worker.worker_id)


def least_loaded_prefill(snapshot: ClusterSnapshot, request: RouteRequest) -> WorkerView:
    return min(snapshot.prefill, key=prefill_load_key)


def least_loaded_decode(candidates: tuple[WorkerView, ...]) -> WorkerView:
    """Fewest running requests, then most free pages, then shortest queue."""
    return min(candidates, key=lambda w: (w.num_running, -w.num_free_pages, w.queue_len, w.worker_id))


def _route(
    snapshot: ClusterSnapshot, request: RouteRequest, pick_prefill: PrefillPicker
) -> RouteDecision | Rejection:
    """Admission, then ``pick_prefill`` and the least loaded fitting decode worker."""
    rejection = admission_rejection(snapshot, request)
    if rejection is not None:
        return rejection
    decode = least_loaded_decode(fitting_decode(snapshot, request))
    return decide(snapshot, request, pick_prefill(snapshot, request), decode)


# --- round robin ----------------------------------------------------------------------


def _by_id(workers: tuple[WorkerView, ...]) -> list[WorkerView]:
    return sorted(workers, key=lambda w: w.worker_id)


def round_robin(snapshot: ClusterSnapshot, request: RouteRequest) -> RouteDecision | Rejection:
    """Prefill ``seq % n`` over workers sorted by id; decode likewise, skipping forward past
    workers without room (so the rotation is unchanged while every decode worker fits)."""
    rejection = admission_rejection(snapshot, request)
    if rejection is not None:
        return rejection
    prefill = _by_id(snapshot.prefill)
    decode = _by_id(snapshot.decode)
    need = decode_need_pages(request)
    start = request.seq % len(decode)
    rotated = decode[start:] + decode[:start]
    chosen = next(w for w in rotated if w.num_free_pages >= need)  # admission found one
    return decide(snapshot, request, prefill[request.seq % len(prefill)], chosen)


# --- least loaded ---------------------------------------------------------------------


def least_loaded(snapshot: ClusterSnapshot, request: RouteRequest) -> RouteDecision | Rejection:
    """Least loaded prefill worker (``prefill_load_key``) and least loaded fitting decode."""
    return _route(snapshot, request, least_loaded_prefill)


register_policy("round_robin")(lambda context: round_robin)
register_policy("least_loaded")(lambda context: least_loaded)


# --- random ---------------------------------------------------------------------------


def _draw(seed: int, request: RouteRequest, salt: str, n: int) -> int:
    """A uniform index in [0, n) that depends only on (seed, request, salt): pure."""
    digest = hashlib.blake2b(f"{seed}/{request.seq}/{request.request_id}/{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % n


def make_random(context: PolicyContext) -> Policy:
    """Uniformly random prefill and fitting decode workers (FAST'25's baseline), seeded by
    ``routing.seed`` and the request, so the same request gets the same answer."""
    seed = context.routing.seed

    def random_policy(snapshot: ClusterSnapshot, request: RouteRequest) -> RouteDecision | Rejection:
        rejection = admission_rejection(snapshot, request)
        if rejection is not None:
            return rejection
        prefill = _by_id(snapshot.prefill)
        decode = _by_id(fitting_decode(snapshot, request))
        chosen = prefill[_draw(seed, request, "prefill", len(prefill))]
        return decide(snapshot, request, chosen, decode[_draw(seed, request, "decode", len(decode))])

    return random_policy


register_policy("random")(make_random)


# --- cache aware (SGLang) -------------------------------------------------------------


@dataclass(frozen=True)
class CacheAwareConfig:
    """When the prefill pool counts as imbalanced: both the absolute gap in queue length
    exceeds ``balance_abs_threshold`` and the longest queue exceeds ``balance_rel_threshold``
    times the shortest. SGLang's router uses 32 and 1.5 for large fleets; a small cluster
    queues far fewer requests per worker, hence 4."""

    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold {self.balance_abs_threshold} < 0")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold {self.balance_rel_threshold} < 1.0")

    def imbalanced(self, workers: tuple[WorkerView, ...]) -> bool:
        queue_lens = [w.queue_len for w in workers]
        longest, shortest = max(queue_lens), min(queue_lens)
        return (
            longest - shortest > self.balance_abs_threshold
            and longest > self.balance_rel_threshold * shortest
        )


def make_cache_aware(config: CacheAwareConfig) -> Policy:
    """A cache-aware policy for ``config``: the least loaded prefill worker while the pool
    is imbalanced, otherwise the deepest (capped) reusable prefix, ties to the least loaded."""

    def pick_prefill(snapshot: ClusterSnapshot, request: RouteRequest) -> WorkerView:
        if config.imbalanced(snapshot.prefill):
            return least_loaded_prefill(snapshot, request)
        return min(snapshot.prefill, key=lambda w: (-capped_usable(w, request), prefill_load_key(w)))

    def cache_aware(snapshot: ClusterSnapshot, request: RouteRequest) -> RouteDecision | Rejection:
        return _route(snapshot, request, pick_prefill)

    return cache_aware


@register_policy("cache_aware")
def _cache_aware_factory(context: PolicyContext) -> Policy:
    r = context.routing
    return make_cache_aware(CacheAwareConfig(r.cache_aware_abs_threshold, r.cache_aware_rel_threshold))
