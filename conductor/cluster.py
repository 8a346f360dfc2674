"""The Conductor's side of the registry: who may join, what the log is told, and the stubs
that reach each worker.

The cluster's state (registrations, leases, loads, block holdings) is owned by
``clusterstate.state.ClusterState`` and changed only through the cluster's log
(``clusterstate.log``), so every Conductor replica holds the same one. This module checks
each change before it goes into the log: a worker may register only itself, with the
cluster's one model and block size (and any extra check the Conductor adds, such as its
calibration's model fingerprint); while an instance of an id is alive, a Register of the same
id from another instance is refused and logged with both addresses; once it has stopped
heartbeating, a new instance replaces it (and its blocks are dropped). Heartbeats, and the
block events on Prefill responses, are published as they come.

The stubs to a worker sign with the session key of the instance that registered it
(``runtime.auth.session_key``, derived from the cluster secret and its instance id), so any
replica can call any worker, whichever one took its Register. They are derived from the
state and cached per instance. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from clusterstate.log import EntryApplier, LocalLog, StateLog, entry, record_of
from clusterstate.records import StoreKeys
from clusterstate.state import ClusterState
from clusterstate.workers import WorkerInfo, WorkerRole
from conductor.snapshot import RegistryEntry
from kvstore.blocks import BlockKey
from kvstore.index import BlockEvent, MatchSnapshot
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from proto import state_pb2 as spb
from proto.convert import (
    block_event,
    block_event_from_proto,
    load_from_proto,
    load_to_proto,
    worker_from_proto,
    worker_to_proto,
)
from runtime.auth import Member, session_key, worker_of, worker_principal

log = logging.getLogger(__name__)
MIN_INSTANCE_ID_LEN = 16


@dataclass(frozen=True)
class Endpoint:
    """How this Conductor reaches one worker instance."""

    info: WorkerInfo
    prefill: igrpc.PrefillStub | None
    decode: igrpc.DecodeStub | None
    session_key: bytes = b""


class Cluster:
    """``state``: what ``log`` applies its entries to; ``check(info)``: an extra registration
    check, returning the reason to refuse or None."""

    def __init__(self, state: ClusterState, state_log: StateLog, member: Member, keys: StoreKeys,
                 check: Callable[[WorkerInfo], str | None] = lambda info: None):
        self.state, self.log, self.member, self.keys = state, state_log, member, keys
        self.replica_id = state_log.replica_id
        self._check = check
        self._lock = threading.Lock()
        self._endpoints: dict[str, Endpoint] = {}  # derived from the state, per worker instance
        self._model: tuple[str, int] | None = None  # (fingerprint, block size) once a worker registered

    @classmethod
    def in_memory(cls, member: Member, ttl_s: float = 10.0, clock: Callable[[], float] = time.time,
                  check: Callable[[WorkerInfo], str | None] = lambda info: None) -> Cluster:
        """A cluster of one Conductor: its own state, an in-process log."""
        state, keys = ClusterState(ttl_s, clock), StoreKeys.from_secret(member.secret)
        return cls(state, LocalLog(EntryApplier(state, keys)), member, keys, check)

    # ---- the model the cluster serves ----------------------------------------------------------
    @property
    def model_fingerprint(self) -> str | None:
        model = self._served()
        return model[0] if model else None

    @property
    def block_size(self) -> int | None:
        model = self._served()
        return model[1] if model else None

    def _served(self) -> tuple[str, int] | None:
        """The model of the first worker this Conductor saw (registered here or through the log)."""
        if self._model is None:
            workers = self.state.workers()
            if workers:
                info = workers[0][0]
                self._model = (info.model_fingerprint, info.block_size)
        return self._model

    # ---- changes ------------------------------------------------------------------------------
    def register(self, wire: ipb.WorkerInfo, principal: str) -> str | None:
        """None when accepted (and in the log), else the reason for refusing the worker.
        ``principal``: who signed the call (a worker may register only its own id)."""
        if principal != worker_principal(wire.worker_id):
            return f"{principal} may not register worker {wire.worker_id}"
        try:
            info = worker_from_proto(wire)
        except ValueError as e:
            return str(e)
        if len(info.instance_id) < MIN_INSTANCE_ID_LEN:
            return f"worker {info.worker_id}: registration without an instance_id"
        reason = self._check(info) or self._check_model(info) or self._check_instance(info)
        if reason is not None:
            log.error("refused worker %s: %s", info.worker_id, reason)
            return reason
        self.log.publish(entry(self.replica_id, self.state.now(), registered=record_of(info, self.keys)))
        log.info("registered %s %s at %s", info.role, info.worker_id, info.rpc_address)
        return None

    def _check_model(self, info: WorkerInfo) -> str | None:
        with self._lock:
            model = self._served() or (info.model_fingerprint, info.block_size)
            self._model = model
        if (info.model_fingerprint, info.block_size) != model:
            return (f"worker {info.worker_id} serves model {info.model_fingerprint} with block size "
                    f"{info.block_size}; this cluster serves {model[0]} with {model[1]}")
        return None

    def _check_instance(self, info: WorkerInfo) -> str | None:
        old = self.state.worker(info.worker_id)
        if old is None or old.instance_id == info.instance_id:
            return None
        log.warning("refused Register of worker %s from %s: that id is alive at %s as another instance",
                    info.worker_id, info.rpc_address, old.rpc_address)
        return (f"worker {info.worker_id} is alive at {old.rpc_address} as another instance; a new "
                f"instance may take the id once the old one stops heartbeating")

    def heartbeat(self, worker_id: str, load: ipb.WorkerLoad, events: Sequence[ipb.BlockEvent], seq: int = 0) -> bool:
        """False when the cluster does not know the worker (it must register again);
        ``ValueError`` for a malformed load or event (checked before anything is published)."""
        if self.state.worker(worker_id) is None:
            return False
        load_from_proto(load)
        for e in events:
            block_event_from_proto(worker_id, e)
        change = spb.HeartbeatEntry(worker_id=worker_id, load=load, events=events, seq=seq)
        self.log.publish(entry(self.replica_id, self.state.now(), heartbeat=change))
        return True

    def deregister(self, worker_id: str, reason: str) -> bool:
        """The worker instance leaves now (a rank of its group died): out of the log's state,
        with its blocks, as an expired lease would take it. False when it is not alive."""
        if self.state.worker(worker_id) is None:
            return False
        self.log.publish(entry(self.replica_id, self.state.now(),
                               removed=spb.RemovedEntry(worker_id=worker_id, reason=reason[:500])))
        log.warning("worker %s deregistered: %s", worker_id, reason)
        return True

    def apply_events(self, events: Sequence[BlockEvent]) -> None:
        """Blocks a prefill stored (from its Prefill response), into the log at once."""
        by_worker: dict[str, list[ipb.BlockEvent]] = {}
        for e in events:
            by_worker.setdefault(e.worker_id, []).append(block_event(e.key, e.tier, e.has_snapshot))
        for worker_id, wire in by_worker.items():
            change = spb.BlocksEntry(worker_id=worker_id, events=wire)
            self.log.publish(entry(self.replica_id, self.state.now(), blocks=change))

    def reap_expired(self) -> tuple[str, ...]:
        """Drop workers whose lease ran out (each replica does so by the same clock)."""
        return self.state.reap_expired()

    # ---- reaching workers ---------------------------------------------------------------------
    def session_key_for(self, principal: str) -> bytes | None:
        """The session key a ``worker/<id>`` principal signs its heartbeats with (None: unknown)."""
        worker_id = worker_of(principal)
        info = self.state.worker(worker_id) if worker_id is not None else None
        return session_key(self.member.secret, info.worker_id, info.instance_id) if info is not None else None

    def endpoint(self, worker_id: str) -> Endpoint:
        """The stubs of the alive worker ``worker_id``; KeyError when it is not alive."""
        info = self.state.worker(worker_id)
        if info is None:
            raise KeyError(f"worker {worker_id} is not alive")
        with self._lock:
            ep = self._endpoints.get(worker_id)
            if ep is None or ep.info != info:
                key = session_key(self.member.secret, info.worker_id, info.instance_id)
                ch = self.member.channel(info.rpc_address, key, audience=worker_principal(info.worker_id))
                is_prefill = info.role is WorkerRole.PREFILL
                ep = self._endpoints[worker_id] = Endpoint(
                    info, igrpc.PrefillStub(ch) if is_prefill else None,
                    None if is_prefill else igrpc.DecodeStub(ch), key)
            return ep

    # ---- reading ------------------------------------------------------------------------------
    @property
    def lag_s(self) -> float:
        """How far the state is behind the cluster's log (seconds; 0: caught up)."""
        return self.log.lag_s

    def match(self, keys: Sequence[BlockKey]) -> MatchSnapshot | None:
        return self.state.match(keys) if keys else None

    def registry_view(self, wall_now_s: float) -> tuple[RegistryEntry, ...]:
        """Alive workers with their latest load and its age (by ``wall_now_s``)."""
        return tuple(RegistryEntry(info, load, max(0.0, wall_now_s - load.timestamp_s) if load.timestamp_s else 0.0)
                     for info, load in self.state.workers())

    def alive(self) -> list[tuple[ipb.WorkerInfo, ipb.WorkerLoad]]:
        """Alive workers as wire messages, without their instance ids (the Registry/Workers RPC)."""
        return [(worker_to_proto(info.public()), load_to_proto(load)) for info, load in self.state.workers()]

