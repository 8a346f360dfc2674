"""The Conductor core: from a request to a frozen routing decision, with no gRPC, threads or
processes of its own, so the simulator drives the same code.

``ConductorCore.route`` computes the block keys, counts the prefix's heat, builds the
``ClusterSnapshot`` (``conductor.snapshot.build_snapshot``: a pure function of the registry
view, the index matches, the pending overlay and the time), asks the policy, and records an
accepted decision in the pending overlay. Applying the decision is the lifecycle's job
(``conductor.lifecycle`` with a ``Dispatcher``); what it learns goes back through the
core's transitions, the only writers of the core's bookkeeping, live and simulated alike:
``prefilled`` (the prefill's blocks go to the index, its time to the speed tracker),
``decoding``, ``generated`` and ``finished``. With Conductor replicas, each transition is also
shared (``share``) so the other replicas' pending overlays count this one's work, and theirs
arrive through ``apply_overlay``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from conductor.clock import Clock
from conductor.config import SLOTable
from conductor.heat import PrefixHeat
from conductor.pending import PendingWork
from conductor.replicas import RemoteReplicas, routed_entry
from conductor.routing import ClusterSnapshot, Policy, Rejection, RejectKind, RouteDecision, RouteRequest, WorkerView
from conductor.snapshot import RegistryEntry, ViewMemo, build_snapshot
from conductor.speed import WorkerSpeed
from kvstore.blocks import BlockKey, chain_keys
from kvstore.index import BlockEvent, MatchSnapshot
from proto import state_pb2 as spb

RETRY_NOT_READY_S = 5.0


class ClusterView(Protocol):
    """What the core reads of the cluster (the live ``Cluster``, or the simulator's)."""

    model_fingerprint: str | None
    block_size: int | None

    def registry_view(self, wall_now_s: float) -> tuple[RegistryEntry, ...]: ...

    def match(self, keys: Sequence[BlockKey]) -> MatchSnapshot | None: ...

    def apply_events(self, events: Sequence[BlockEvent]) -> None:
        """Blocks a prefill stored, into the index before the next request routes."""


@dataclass(frozen=True)
class Routed:
    """The outcome of routing one request: the decision (or rejection) and what it was made on."""

    outcome: RouteDecision | Rejection
    request: RouteRequest | None  # None when no worker has registered yet
    keys: tuple[BlockKey, ...]
    snapshot: ClusterSnapshot | None


@dataclass(frozen=True)
class RequestFacts:
    """What routing reads of a request. ``block_keys`` None: computed from ``prompt_ids`` with
    the cluster's block size and model fingerprint (the simulator passes keys it derived from
    a trace's hash ids, with ``num_prompt_tokens`` and no tokens)."""

    request_id: str
    seq: int
    prompt_ids: tuple[int, ...]
    max_tokens: int
    tenant: str
    ttft_slo_s: float = 0.0  # 0: the tenant's or cluster's
    tbt_slo_s: float = 0.0
    block_keys: tuple[BlockKey, ...] | None = None
    num_prompt_tokens: int = 0  # 0: len(prompt_ids)
    live_key: bytes = b""  # the client's (tenant, request id), hashed: other replicas refuse a duplicate

    @property
    def prompt_len(self) -> int:
        return self.num_prompt_tokens or len(self.prompt_ids)


class ConductorCore:
    """``share(entry)``: hands each transition on to the other Conductor replicas (none: one
    Conductor); ``block_key_secret``: the cluster's key of the block hashes."""

    def __init__(self, cluster: ClusterView, policy: Policy, slos: SLOTable, clock: Clock,
                 pending: PendingWork | None = None, heat: PrefixHeat | None = None,
                 share: Callable[[spb.PendingEntry], None] | None = None, block_key_secret: bytes = b""):
        self.cluster, self.policy, self.slos, self.clock = cluster, policy, slos, clock
        self.block_key_secret = block_key_secret  # keys the block hashes (kvstore.blocks)
        self.pending = pending or PendingWork()
        self.heat = heat or PrefixHeat()
        self.speed = WorkerSpeed()
        self._share = share
        self.replicas = RemoteReplicas(self.pending)
        self._views = ViewMemo()  # the last snapshot's views, reused where nothing changed
        # One decision at a time: a request must see the overlay of the one routed just before it.
        self._lock = threading.Lock()

    def route(self, facts: RequestFacts, avoid: Sequence[str] = ()) -> Routed:
        """Decide for ``facts``; workers in ``avoid`` (the one that failed longest ago first)
        are left out. When that leaves no worker of a role, the ones that failed longest ago
        are allowed again first (``_without``). An accepted decision is recorded in the
        pending overlay."""
        fp, bs = self.cluster.model_fingerprint, self.cluster.block_size
        if fp is None or bs is None:
            return Routed(Rejection("no workers registered yet", RETRY_NOT_READY_S, RejectKind.NO_WORKERS),
                          None, (), None)
        keys = facts.block_keys
        if keys is None:
            keys = tuple(chain_keys(facts.prompt_ids, bs, fp, facts.tenant, self.block_key_secret))
        slo = self.slos.resolve(facts.tenant, facts.ttft_slo_s, facts.tbt_slo_s)
        request = RouteRequest(facts.request_id, facts.seq, facts.prompt_len, len(keys), facts.max_tokens, bs,
                               slo.ttft_s, slo.tbt_s)
        matches = self.cluster.match(keys)
        with self._lock:
            now_s = self.clock.now()
            rate = self.heat.touch(keys[0], now_s) if keys else 0.0
            registry = self.cluster.registry_view(self.clock.wall())
            snapshot = build_snapshot(registry, matches, self.pending.view(), now_s, rate, self.speed.paces(),
                                      self._views)
            if avoid:
                snapshot = ClusterSnapshot(_without(snapshot.prefill, avoid), _without(snapshot.decode, avoid),
                                           snapshot.time_s, snapshot.prefix_rate_per_s)
            outcome = self.policy(snapshot, request)
            if isinstance(outcome, RouteDecision):
                record = self.pending.route(request, outcome, now_s)
                if self._share is not None:
                    self._share(routed_entry(record, facts.live_key))
        return Routed(outcome, request, keys, snapshot)

    # ---- transitions: what applying a decision tells the core ---------------------------------
    def prefilled(self, request_id: str, prefill_worker: str, model_prefill_s: float, worker_prefill_s: float,
                  events: Sequence[BlockEvent] = (), *, handoff_s: float = 0.0,
                  dispatch_s: float | None = None) -> None:
        """A placement's prefill returned its first token: it leaves the prefill queue, its
        stored blocks enter the index, and the worker's times against the prediction update
        its pace (``WorkerSpeed.observe``: ``handoff_s`` of ``worker_prefill_s``, and the
        request's dispatch when measured)."""
        self.pending.prefill_done(request_id, self.clock.now())
        if events:
            self.cluster.apply_events(events)
        self.speed.observe(prefill_worker, model_prefill_s, worker_prefill_s, handoff_s, dispatch_s)
        self._shared(spb.PENDING_KIND_PREFILL_DONE, request_id)

    def decoding(self, request_id: str) -> None:
        """The request joined (or is joining) its decode worker's batch."""
        self.pending.decode_started(request_id, self.clock.now())
        self._shared(spb.PENDING_KIND_DECODING, request_id)

    def generated(self, request_id: str, num_tokens: int) -> None:
        """The current placement has generated ``num_tokens`` (kept here only: heartbeats carry
        the decode workers' context to the other replicas)."""
        self.pending.generated(request_id, num_tokens)

    def finished(self, request_id: str) -> None:
        """The request ended (any way) or is placed again: its work leaves both workers."""
        if self.pending.finish(request_id, self.clock.now()):
            self._shared(spb.PENDING_KIND_FINISHED, request_id)

    def _shared(self, kind: int, request_id: str) -> None:
        if self._share is not None:
            self._share(spb.PendingEntry(kind=kind, request_id=request_id))

    def apply_overlay(self, entry: spb.StateEntry) -> None:
        """Another replica's transition or liveness (from the cluster's log)."""
        self.replicas.apply(entry, self.clock.now(), self.clock.wall())


def _without(workers: tuple[WorkerView, ...], avoid: Sequence[str]) -> tuple[WorkerView, ...]:
    """``workers`` minus ``avoid``; when that leaves none, minus only the most recent entries
    of ``avoid`` that leave some (all of ``workers`` when every entry must go)."""
    for oldest_allowed in range(len(avoid) + 1):
        recent = set(avoid[oldest_allowed:])
        left = tuple(w for w in workers if w.worker_id not in recent)
        if left:
            return left
    return workers
