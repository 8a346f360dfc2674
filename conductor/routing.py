"""Routing vocabulary and registry: the values a routing policy reads and returns, the
registry of policies by name, and the rules every policy shares.

A policy is a pure function ``policy(snapshot, request) -> RouteDecision | Rejection``
(STYLE rule 2). It reads a frozen ``ClusterSnapshot`` and a frozen ``RouteRequest``, changes
nothing, and gives the same answer for the same inputs, so the live Conductor, the simulator
and the tests run the same code. The Conductor applies the decision; this module applies
nothing.

Shared rules, one helper each, so that every policy (and later ``mooncake``) agrees on them:

- ``admission_rejection``: no prefill or no decode workers, or no decode worker with room for
  the whole sequence -> a ``Rejection`` with the numbers and a retry hint.
- ``fitting_decode``: decode workers with ``num_free_pages >= decode_need_pages(request)``.
- ``max_reuse_blocks``: the reuse cap. The last prompt token is always computed (its logits
  give the first output token), so at most ``(num_prompt_tokens - 1) // block_size`` blocks::

      block_size = 4, num_prompt_tokens = 8, num_blocks = 2
      tokens  | t0 t1 t2 t3 | t4 t5 t6 t7 |
      blocks  |  block 0    |  block 1    |
      cap = (8 - 1) // 4 = 1: block 1 holds t7, the token prefill must compute.

- ``plan_reuse``: the chosen prefill worker reuses its own prefix unless another worker's
  (capped) prefix is deeper, in which case it pulls that deeper prefix from that worker.

The policies themselves live in ``conductor.policies``; ``get_policy`` and ``policy_names``
import it on first use, so ``from conductor.routing import get_policy`` is enough.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

PREFILL = "prefill"
DECODE = "decode"
ROLES = (PREFILL, DECODE)
NUM_TIERS = 3  # 0 device, 1 DRAM, 2 SSD

RETRY_NO_WORKERS_S = 5.0  # workers take seconds to start and register
RETRY_DECODE_FULL_S = 1.0  # decode memory frees as running requests finish


@dataclass(frozen=True)
class WorkerView:
    """One worker as seen in one snapshot. Counts are non-negative; pages are blocks of the
    decode worker's paged cache (``block_size`` tokens each)."""

    worker_id: str
    role: str  # "prefill" | "decode"
    rpc_address: str
    transfer_address: str
    queue_len: int = 0
    num_running: int = 0
    num_free_pages: int = 0
    num_tokens_in_flight: int = 0
    usable_blocks: int = 0  # prefill only: deepest reusable prefix (blocks) held for THIS request
    usable_tier: int | None = None  # slowest tier in that prefix (0 device, 1 DRAM, 2 SSD)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker {self.worker_id!r}: role {self.role!r} is not one of {ROLES}")
        counts = {
            "queue_len": self.queue_len,
            "num_running": self.num_running,
            "num_free_pages": self.num_free_pages,
            "num_tokens_in_flight": self.num_tokens_in_flight,
            "usable_blocks": self.usable_blocks,
        }
        negative = {name: value for name, value in counts.items() if value < 0}
        if negative:
            raise ValueError(f"worker {self.worker_id!r}: negative counts {negative}")
        if self.usable_tier is not None and not 0 <= self.usable_tier < NUM_TIERS:
            raise ValueError(f"worker {self.worker_id!r}: usable_tier {self.usable_tier} not in 0..2")


@dataclass(frozen=True)
class RouteRequest:
    """What routing needs to know about one request (token counts, not the tokens)."""

    request_id: str
    seq: int  # arrival sequence number given by the Conductor (round robin uses it: pure)
    num_prompt_tokens: int
    num_blocks: int  # full blocks in the prompt
    max_tokens: int
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"request {self.request_id}: block_size {self.block_size} < 1")
        if self.num_prompt_tokens < 1:
            raise ValueError(f"request {self.request_id}: num_prompt_tokens {self.num_prompt_tokens} < 1")
        if self.max_tokens < 0:
            raise ValueError(f"request {self.request_id}: max_tokens {self.max_tokens} < 0")
        full_blocks = self.num_prompt_tokens // self.block_size
        if not 0 <= self.num_blocks <= full_blocks:
            raise ValueError(
                f"request {self.request_id}: num_blocks {self.num_blocks} not in 0..{full_blocks} "
                f"({self.num_prompt_tokens} prompt tokens, block size {self.block_size})"
            )


@dataclass(frozen=True)
class ClusterSnapshot:
    """Every live worker at one instant, split by role. Worker ids are unique."""

    prefill: tuple[WorkerView, ...]
    decode: tuple[WorkerView, ...]
    time_s: float = 0.0

    def __post_init__(self) -> None:
        for role, workers in ((PREFILL, self.prefill), (DECODE, self.decode)):
            wrong = [w.worker_id for w in workers if w.role != role]
            if wrong:
                raise ValueError(f"snapshot: workers {wrong} listed as {role} have another role")
        ids = [w.worker_id for w in self.prefill + self.decode]
        if len(set(ids)) != len(ids):
            raise ValueError(f"snapshot: duplicate worker ids in {sorted(ids)}")

    def find(self, worker_id: str) -> WorkerView | None:
        return next((w for w in self.prefill + self.decode if w.worker_id == worker_id), None)


@dataclass(frozen=True)
class ReusePlan:
    num_blocks: int  # leading blocks the chosen prefill worker will reuse
    holder: str | None  # None: its own tiers; else the worker_id to pull them from


@dataclass(frozen=True)
class RouteDecision:
    prefill_worker: str
    decode_worker: str
    reuse: ReusePlan


@dataclass(frozen=True)
class Rejection:
    reason: str  # human-readable, names the resource and the numbers
    retry_after_s: float


Policy = Callable[[ClusterSnapshot, RouteRequest], RouteDecision | Rejection]


# --- registry -------------------------------------------------------------------------

_POLICIES: dict[str, Policy] = {}
_BUILTIN_MODULE = "conductor.policies"


def register_policy(name: str) -> Callable[[Policy], Policy]:
    """Decorator: register ``policy`` under ``name``. A second policy with the same name
    raises ``ValueError``. Mutates the module registry (import time only)."""

    def register(policy: Policy) -> Policy:
        if name in _POLICIES and _POLICIES[name] is not policy:
            raise ValueError(f"routing policy {name!r} is already registered")
        _POLICIES[name] = policy
        return policy

    return register


def _load_builtin_policies() -> None:
    importlib.import_module(_BUILTIN_MODULE)  # registers on first import; cached afterwards


def get_policy(name: str) -> Policy:
    """The policy registered as ``name``; ``ValueError`` listing the known names if none."""
    _load_builtin_policies()
    if name not in _POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; registered: {', '.join(policy_names())}")
    return _POLICIES[name]


def policy_names() -> list[str]:
    """Registered policy names, sorted."""
    _load_builtin_policies()
    return sorted(_POLICIES)


# --- shared rules ---------------------------------------------------------------------


def max_reuse_blocks(request: RouteRequest) -> int:
    """Most leading blocks any worker may reuse: full blocks that leave the last prompt token
    to compute (its logits sample the first output token)."""
    return min(request.num_blocks, (request.num_prompt_tokens - 1) // request.block_size)


def decode_need_pages(request: RouteRequest) -> int:
    """Pages a decode worker must have free for the prompt plus every output token."""
    return math.ceil((request.num_prompt_tokens + request.max_tokens) / request.block_size)


def fitting_decode(snapshot: ClusterSnapshot, request: RouteRequest) -> tuple[WorkerView, ...]:
    """Decode workers with room for the whole sequence, in snapshot order; empty if none."""
    need = decode_need_pages(request)
    return tuple(w for w in snapshot.decode if w.num_free_pages >= need)


def admission_rejection(snapshot: ClusterSnapshot, request: RouteRequest) -> Rejection | None:
    """The rejection every policy gives before choosing, or None when routing can proceed:
    no prefill workers, no decode workers, or no decode worker with enough free pages."""
    if not snapshot.prefill:
        return Rejection("no prefill workers registered", RETRY_NO_WORKERS_S)
    if not snapshot.decode:
        return Rejection("no decode workers registered", RETRY_NO_WORKERS_S)
    if fitting_decode(snapshot, request):
        return None
    best = min(snapshot.decode, key=lambda w: (-w.num_free_pages, w.worker_id))
    return Rejection(
        f"no decode worker has room: need {decode_need_pages(request)} free pages "
        f"({request.num_prompt_tokens} prompt + {request.max_tokens} max tokens, "
        f"block size {request.block_size}); most free is {best.num_free_pages} on {best.worker_id}",
        RETRY_DECODE_FULL_S,
    )


def capped_usable(worker: WorkerView, request: RouteRequest) -> int:
    """The worker's reusable prefix depth for this request, after the reuse cap."""
    return min(worker.usable_blocks, max_reuse_blocks(request))


def _tier_rank(worker: WorkerView) -> int:
    return NUM_TIERS if worker.usable_tier is None else worker.usable_tier


def best_holder(
    workers: tuple[WorkerView, ...], request: RouteRequest, exclude: str | None = None
) -> WorkerView | None:
    """The prefill worker (other than ``exclude``) with the deepest capped prefix; ties go to
    the faster slowest-tier, then the smallest worker_id. None if no worker has a block."""
    others = [w for w in workers if w.worker_id != exclude and capped_usable(w, request) > 0]
    if not others:
        return None
    return min(others, key=lambda w: (-capped_usable(w, request), _tier_rank(w), w.worker_id))


def plan_reuse(
    snapshot: ClusterSnapshot, request: RouteRequest, chosen: WorkerView, min_pull_gain_blocks: int = 1
) -> ReusePlan:
    """Reuse plan for ``chosen``: its own prefix, unless another worker's capped prefix is at
    least ``min_pull_gain_blocks`` deeper; then pull that whole prefix from that worker."""
    own = capped_usable(chosen, request)
    holder = best_holder(snapshot.prefill, request, exclude=chosen.worker_id)
    if holder is not None and capped_usable(holder, request) >= own + max(1, min_pull_gain_blocks):
        return ReusePlan(num_blocks=capped_usable(holder, request), holder=holder.worker_id)
    return ReusePlan(num_blocks=own, holder=None)


def decide(
    snapshot: ClusterSnapshot, request: RouteRequest, prefill: WorkerView, decode: WorkerView
) -> RouteDecision:
    """The decision for a chosen pair, with the shared reuse plan."""
    return RouteDecision(prefill.worker_id, decode.worker_id, plan_reuse(snapshot, request, prefill))


def check_decision(snapshot: ClusterSnapshot, request: RouteRequest, decision: RouteDecision) -> None:
    """Assert that ``decision`` obeys the shared rules against ``snapshot``: workers exist in
    their roles, the decode worker fits, and the reuse plan is within the cap and held."""
    prefill = snapshot.find(decision.prefill_worker)
    decode = snapshot.find(decision.decode_worker)
    assert prefill is not None and prefill.role == PREFILL, f"bad prefill worker {decision.prefill_worker}"
    assert decode is not None and decode.role == DECODE, f"bad decode worker {decision.decode_worker}"
    need = decode_need_pages(request)
    assert decode.num_free_pages >= need, f"{decode.worker_id}: {decode.num_free_pages} free < {need}"
    reuse = decision.reuse
    assert 0 <= reuse.num_blocks <= max_reuse_blocks(request), f"reuse {reuse} over the cap"
    source = prefill if reuse.holder is None else snapshot.find(reuse.holder)
    assert source is not None and source.role == PREFILL, f"bad holder {reuse.holder}"
    assert reuse.holder != prefill.worker_id, "holder must be another worker (None means own tiers)"
    assert source.usable_blocks >= reuse.num_blocks, f"{source.worker_id} holds fewer than {reuse}"
