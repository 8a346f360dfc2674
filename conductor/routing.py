"""Routing vocabulary and registry: the values a routing policy reads and returns, the
registry of policy factories by name, and the rules every policy shares.

A policy is a pure function ``policy(snapshot, request) -> RouteDecision | Rejection``
(STYLE rule 2). It reads a frozen ``ClusterSnapshot`` and a frozen ``RouteRequest``, changes
nothing, and gives the same answer for the same inputs, so the live Conductor, the simulator
and the tests run the same code. Policies are registered as factories that take a
``PolicyContext`` (their config and the cost models) and return the policy; nothing is built
at import. The Conductor applies the decision; this module applies nothing.

Shared rules, one helper each, so that every policy agrees on them:

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

The policies live in ``conductor.policies``, ``conductor.kv_cost`` and ``conductor.mooncake``;
``make_policy`` and ``policy_names`` import them on first use.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from clusterstate.workers import PrefillJobLoad, WorkerRole
from conductor.routing_config import RoutingConfig
from kvstore.blocks import Tier

if TYPE_CHECKING:
    from costmodel import CostModels

RETRY_NO_WORKERS_S = 5.0  # workers take seconds to start and register
RETRY_DECODE_FULL_S = 1.0  # decode memory frees as running requests finish


class RouteBranch(enum.StrEnum):
    """Where the reused prefix comes from: none, the chosen worker's own tiers, a pull from
    the holder because it predicts the lower TTFT, or a pull that replicates a hot prefix."""

    COLD = "cold"
    LOCAL = "local"
    PULL = "pull"
    REPLICATE = "replicate"


class RejectKind(enum.StrEnum):
    NO_WORKERS = "no_workers"
    DECODE_FULL = "decode_full"
    TTFT_SLO = "ttft_slo"
    TBT_SLO = "tbt_slo"


@dataclass(frozen=True)
class DecodeJob:
    """A request on (or about to join) a decode worker, as this Conductor knows it."""

    request_id: str
    num_tokens: int  # context it holds now (prompt + generated)
    num_remaining_tokens: int  # tokens it may still generate
    decoding: bool = True  # in the running batch; else still in prefill, joining at ready_at_s
    ready_at_s: float = 0.0  # predicted moment it joins (the snapshot's clock)

    def ready_in_s(self, now_s: float) -> float:
        """0 while decoding; else the predicted seconds until it joins (at least a tick)."""
        return 0.0 if self.decoding else max(1e-6, self.ready_at_s - now_s)


@dataclass(frozen=True)
class WorkerView:
    """One worker as seen in one snapshot: its last heartbeat plus what this Conductor routed
    there since (the pending overlay, ``conductor.snapshot``). Pages are blocks of the worker's
    paged cache (``block_size`` tokens each); counts are non-negative."""

    worker_id: str
    role: WorkerRole
    rpc_address: str
    transfer_address: str
    num_free_pages: int = 0
    num_running: int = 0  # decode: requests in the running batch
    num_queued: int = 0  # decode: reserved, not yet decoding
    num_context_tokens: int = 0  # decode: tokens held by running requests
    prefill_jobs: tuple[PrefillJobLoad, ...] = ()  # prefill: queued and running prefills, in order
    decode_jobs: tuple[DecodeJob, ...] = ()  # decode: the requests this Conductor knows there
    usable_blocks: int = 0  # prefill only: deepest reusable prefix (blocks) held for THIS request
    usable_tier: Tier | None = None  # slowest tier in that prefix
    # Prefill only, its pace lately (conductor.speed): engine time over the calibrated one, the KV
    # hand-off each prefill adds, the dispatch (RPCs, Conductor) around the worker's queue and prefill.
    slowdown: float = 1.0
    handoff_s: float = 0.0
    dispatch_s: float = 0.0
    cpp_stages: int = 1  # prefill only: a chunked-pipeline group of this many stages (conductor.cpp)
    cpp_chunk_tokens: int = 0  # its pipeline chunk

    def __post_init__(self) -> None:
        if type(self.role) is not WorkerRole:
            object.__setattr__(self, "role", WorkerRole(self.role))
        if min(self.num_free_pages, self.num_running, self.num_queued, self.num_context_tokens,
               self.usable_blocks) < 0:
            counts = {"num_free_pages": self.num_free_pages, "num_running": self.num_running,
                      "num_queued": self.num_queued, "num_context_tokens": self.num_context_tokens,
                      "usable_blocks": self.usable_blocks}
            negative = {name: value for name, value in counts.items() if value < 0}
            raise ValueError(f"worker {self.worker_id!r}: negative counts {negative}")
        if self.usable_tier is not None and type(self.usable_tier) is not Tier:
            object.__setattr__(self, "usable_tier", Tier(self.usable_tier))

    @property
    def queue_len(self) -> int:
        """Requests ahead of a new one: prefills held (queued or running), or joining decodes."""
        return len(self.prefill_jobs) if self.role is WorkerRole.PREFILL else self.num_queued

    @property
    def num_queued_tokens(self) -> int:
        """Prefill tokens still to compute on this worker (queued and running jobs)."""
        return sum(j.num_new_tokens for j in self.prefill_jobs)

    @property
    def transfer_backend(self) -> str:
        return self.transfer_address.partition("://")[0] or "tcp"


@dataclass(frozen=True)
class RouteRequest:
    """What routing needs to know about one request (token counts, not the tokens)."""

    request_id: str
    seq: int  # arrival sequence number given by the Conductor (round robin uses it: pure)
    num_prompt_tokens: int
    num_blocks: int  # full blocks in the prompt
    max_tokens: int
    block_size: int
    ttft_slo_s: float = math.inf  # resolved: the request's, its tenant's or the cluster's
    tbt_slo_s: float = math.inf

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
        if not (self.ttft_slo_s > 0 and self.tbt_slo_s > 0):
            raise ValueError(f"request {self.request_id}: SLOs must be > 0")


@dataclass(frozen=True)
class ClusterSnapshot:
    """Every live worker at one instant, split by role. Worker ids are unique.

    ``prefix_rate_per_s``: how often this request's leading block was asked for lately (the
    Conductor's prefix heat), which the hot-prefix rule reads."""

    prefill: tuple[WorkerView, ...]
    decode: tuple[WorkerView, ...]
    time_s: float = 0.0
    prefix_rate_per_s: float = 0.0

    def __post_init__(self) -> None:
        for role, workers in ((WorkerRole.PREFILL, self.prefill), (WorkerRole.DECODE, self.decode)):
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
class Prediction:
    """What a time-aware policy predicted for its decision (zeros: it predicts nothing)."""

    ttft_s: float = 0.0  # dispatch + queue + transfer + prefill on the chosen worker
    queue_s: float = 0.0
    prefill_s: float = 0.0  # the engine's time x the worker's slowdown, plus its hand-off
    transfer_s: float = 0.0
    tbt_s: float = 0.0  # decode step time on the chosen decode worker after this request joins
    slowdown: float = 1.0  # the prefill worker's speed factor the engine's time was scaled by
    handoff_s: float = 0.0  # of prefill_s, the worker's KV hand-off (conductor.speed)
    dispatch_s: float = 0.0  # of ttft_s, the RPCs and the Conductor around the worker

    @property
    def model_prefill_s(self) -> float:
        """The calibrated cost model's prefill time, before the worker's speed factor and hand-off."""
        engine_s = max(0.0, self.prefill_s - self.handoff_s)
        return engine_s / self.slowdown if self.slowdown > 0 else engine_s


@dataclass(frozen=True)
class RouteDecision:
    prefill_worker: str
    decode_worker: str
    reuse: ReusePlan
    branch: RouteBranch = RouteBranch.COLD
    predicted: Prediction = field(default_factory=Prediction)
    cpp_chunk_tokens: int = 0  # a CPP group pipelines the prompt in chunks of this (0: not; conductor.cpp)


@dataclass(frozen=True)
class Rejection:
    reason: str  # human-readable, names the resource and the numbers
    retry_after_s: float
    kind: RejectKind = RejectKind.NO_WORKERS


Policy = Callable[[ClusterSnapshot, RouteRequest], RouteDecision | Rejection]


@dataclass(frozen=True)
class PolicyContext:
    """What a policy factory builds from: the routing config and the cost models (None for
    policies that predict nothing; a policy that needs them raises ValueError when missing)."""

    routing: RoutingConfig = field(default_factory=RoutingConfig)
    costs: CostModels | None = None


PolicyFactory = Callable[[PolicyContext], Policy]

# --- registry -------------------------------------------------------------------------

_FACTORIES: dict[str, PolicyFactory] = {}
_BUILTIN_MODULES = ("conductor.policies", "conductor.kv_cost", "conductor.mooncake")


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Decorator: register a policy factory under ``name``. A second factory with the same
    name raises ``ValueError``. Mutates the module registry (import time only)."""

    def register(factory: PolicyFactory) -> PolicyFactory:
        if name in _FACTORIES and _FACTORIES[name] is not factory:
            raise ValueError(f"routing policy {name!r} is already registered")
        _FACTORIES[name] = factory
        return factory

    return register


def _load_builtin_policies() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)  # registers on first import; cached afterwards


def make_policy(name: str, context: PolicyContext | None = None) -> Policy:
    """The policy registered as ``name`` built for ``context``; ``ValueError`` listing the
    known names if none."""
    _load_builtin_policies()
    if name not in _FACTORIES:
        raise ValueError(f"unknown routing policy {name!r}; registered: {', '.join(policy_names())}")
    context = context or PolicyContext()
    policy = _FACTORIES[name](context)
    policy = policy if context.routing.pull_from_peers else _local_reuse_only(policy)
    from conductor.cpp import with_pipeline

    return with_pipeline(policy, context.costs)


def _local_reuse_only(policy: Policy) -> Policy:
    """``policy`` with every pull replaced by the chosen worker's own prefix (FAST'25's
    "local cache-aware" baselines). Time-aware policies read the flag themselves."""

    def local(snapshot: ClusterSnapshot, request: RouteRequest) -> RouteDecision | Rejection:
        decision = policy(snapshot, request)
        if isinstance(decision, Rejection) or decision.reuse.holder is None:
            return decision
        chosen = snapshot.find(decision.prefill_worker)
        assert chosen is not None
        reuse = ReusePlan(capped_usable(chosen, request), None)
        return dataclasses.replace(decision, reuse=reuse, branch=branch_of(reuse))

    return local


def policy_names() -> list[str]:
    """Registered policy names, sorted."""
    _load_builtin_policies()
    return sorted(_FACTORIES)


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
    return tuple([w for w in snapshot.decode if w.num_free_pages >= need])


def admission_rejection(snapshot: ClusterSnapshot, request: RouteRequest) -> Rejection | None:
    """The rejection every policy gives before choosing, or None when routing can proceed:
    no prefill workers, no decode workers, or no decode worker with enough free pages."""
    if not snapshot.prefill:
        return Rejection("no prefill workers registered", RETRY_NO_WORKERS_S)
    if not snapshot.decode:
        return Rejection("no decode workers registered", RETRY_NO_WORKERS_S)
    need = decode_need_pages(request)
    if any(w.num_free_pages >= need for w in snapshot.decode):  # fitting_decode's test, to the first that fits
        return None
    best = min(snapshot.decode, key=lambda w: (-w.num_free_pages, w.worker_id))
    return Rejection(
        f"no decode worker has room: need {decode_need_pages(request)} free pages "
        f"({request.num_prompt_tokens} prompt + {request.max_tokens} max tokens, "
        f"block size {request.block_size}); most free is {best.num_free_pages} on {best.worker_id}",
        RETRY_DECODE_FULL_S, RejectKind.DECODE_FULL,
    )


def capped_usable(worker: WorkerView, request: RouteRequest) -> int:
    """The worker's reusable prefix depth for this request, after the reuse cap."""
    return min(worker.usable_blocks, max_reuse_blocks(request))


def _tier_rank(worker: WorkerView) -> int:
    return len(Tier) if worker.usable_tier is None else int(worker.usable_tier)


def best_holder(
    workers: tuple[WorkerView, ...], request: RouteRequest, exclude: str | None = None
) -> WorkerView | None:
    """The prefill worker (other than ``exclude``) with the deepest capped prefix; ties go to
    the faster slowest-tier, then the smallest worker_id. None if no worker has a block."""
    if max_reuse_blocks(request) <= 0:
        return None
    # A worker's capped prefix is above 0 exactly when it has usable blocks (the cap is above 0).
    others = [w for w in workers if w.usable_blocks and w.worker_id != exclude]
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


def branch_of(reuse: ReusePlan) -> RouteBranch:
    if reuse.num_blocks == 0:
        return RouteBranch.COLD
    return RouteBranch.LOCAL if reuse.holder is None else RouteBranch.PULL


def decide(
    snapshot: ClusterSnapshot, request: RouteRequest, prefill: WorkerView, decode: WorkerView
) -> RouteDecision:
    """The decision for a chosen pair, with the shared reuse plan."""
    reuse = plan_reuse(snapshot, request, prefill)
    return RouteDecision(prefill.worker_id, decode.worker_id, reuse, branch_of(reuse))
