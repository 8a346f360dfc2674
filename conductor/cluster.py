"""The Conductor's registry side: the global index, worker addresses and stubs.

Owns registration checks (one model, one block size, and any extra check the Conductor
adds, such as its calibration's model fingerprint), heartbeats into the index, block events
into the index, gRPC stubs per worker, and the registry view a snapshot is built from.

A worker id is bound to the instance that registered it (``WorkerInfo.instance_id``, a
secret the process drew): while that instance is alive, a Register of the same id from
another instance is refused and logged with both addresses; once it has stopped
heartbeating, a new instance replaces it (and its blocks are dropped). Each worker's stubs
sign with the session key of its instance (``runtime.auth``), which also checks its
heartbeats (``session_key_for``). Thread-safe: the index is; the local maps are guarded by
one lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from conductor.snapshot import RegistryEntry
from kvstore.blocks import BlockKey
from kvstore.index import BlockEvent, GlobalIndex, MatchSnapshot, WorkerInfo, WorkerRole
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from proto.convert import block_event_from_proto, load_from_proto, load_to_proto
from runtime.auth import Member, session_key, worker_of, worker_principal

log = logging.getLogger(__name__)

ROLE = {ipb.WORKER_ROLE_PREFILL: WorkerRole.PREFILL, ipb.WORKER_ROLE_DECODE: WorkerRole.DECODE}


@dataclass(frozen=True)
class Endpoint:
    info: ipb.WorkerInfo
    prefill: igrpc.PrefillStub | None
    decode: igrpc.DecodeStub | None
    session_key: bytes = b""


class Cluster:
    def __init__(self, index: GlobalIndex, member: Member,
                 check: Callable[[ipb.WorkerInfo], str | None] = lambda info: None):
        """``member``: the Conductor's credential; ``check(info)``: an extra registration
        check, returning the reason to refuse or None."""
        self.index = index
        self.member = member
        self._check = check
        self._lock = threading.Lock()
        self._endpoints: dict[str, Endpoint] = {}
        self.model_fingerprint: str | None = None
        self.block_size: int | None = None

    # ---- registry -----------------------------------------------------------------------------
    def register(self, info: ipb.WorkerInfo, principal: str) -> str | None:
        """None when accepted, else the reason for refusing the worker. ``principal``: who
        signed the call (a worker may register only its own id)."""
        if principal != worker_principal(info.worker_id):
            return f"{principal} may not register worker {info.worker_id}"
        if info.role not in ROLE:
            return f"worker {info.worker_id}: role must be prefill or decode"
        if len(info.instance_id) < 16:
            return f"worker {info.worker_id}: registration without an instance_id"
        reason = self._check(info)
        if reason is not None:
            log.error("refused worker %s: %s", info.worker_id, reason)
            return reason
        alive = {w.worker_id for w, _ in self.index.workers()}
        with self._lock:
            if self.model_fingerprint is None:
                self.model_fingerprint, self.block_size = info.model_fingerprint, info.block_size
            if info.model_fingerprint != self.model_fingerprint or info.block_size != self.block_size:
                return (f"worker {info.worker_id} serves model {info.model_fingerprint} with block size "
                        f"{info.block_size}; this cluster serves {self.model_fingerprint} with {self.block_size}")
            old = self._endpoints.get(info.worker_id)
            replaced = old is not None and old.info.instance_id != info.instance_id
            if replaced and info.worker_id in alive:
                log.warning("refused Register of worker %s from %s: that id is alive at %s as another instance",
                            info.worker_id, info.rpc_address, old.info.rpc_address)
                return (f"worker {info.worker_id} is alive at {old.info.rpc_address} as another instance; a new "
                        f"instance may take the id once the old one stops heartbeating")
            key = session_key(self.member.secret, info.worker_id, info.instance_id)
            ch = self.member.channel(info.rpc_address, key, audience=worker_principal(info.worker_id))
            is_prefill = info.role == ipb.WORKER_ROLE_PREFILL
            self._endpoints[info.worker_id] = Endpoint(
                info, igrpc.PrefillStub(ch) if is_prefill else None, None if is_prefill else igrpc.DecodeStub(ch),
                key)
        if replaced:  # a new process under the id: what the old one held is not held now
            log.warning("worker %s re-registered as a new instance from %s (was %s): dropping its old blocks",
                        info.worker_id, info.rpc_address, old.info.rpc_address)
            self.index.remove(info.worker_id)
        self.index.register(WorkerInfo(info.worker_id, ROLE[info.role], info.rpc_address, info.num_pages_total,
                                       info.dram_capacity_bytes, info.ssd_capacity_bytes))
        log.info("registered %s %s at %s", ROLE[info.role], info.worker_id, info.rpc_address)
        return None

    def session_key_for(self, principal: str) -> bytes | None:
        """The session key a ``worker/<id>`` principal signs its heartbeats with (None: unknown)."""
        worker_id = worker_of(principal)
        with self._lock:
            ep = self._endpoints.get(worker_id) if worker_id is not None else None
        return ep.session_key if ep is not None else None

    def heartbeat(self, worker_id: str, load: ipb.WorkerLoad, events: Sequence[ipb.BlockEvent]) -> bool:
        """False when this Conductor does not know the worker (it must register again)."""
        with self._lock:
            if worker_id not in self._endpoints:
                return False
        alive = self.index.heartbeat(worker_id, load_from_proto(load))
        if alive:
            self.index.apply([block_event_from_proto(worker_id, e) for e in events])
        return alive

    def apply_events(self, events: Sequence[BlockEvent]) -> None:
        if events:
            self.index.apply(events)

    def endpoint(self, worker_id: str) -> Endpoint:
        with self._lock:
            return self._endpoints[worker_id]

    def match(self, keys: Sequence[BlockKey]) -> MatchSnapshot | None:
        return self.index.match(keys) if keys else None

    def registry_view(self, wall_now_s: float) -> tuple[RegistryEntry, ...]:
        """Alive workers known here, with their latest load and its age (by ``wall_now_s``)."""
        with self._lock:
            known = dict(self._endpoints)
        out = []
        for info, load in self.index.workers():
            ep = known.get(info.worker_id)
            if ep is None:
                continue
            age_s = max(0.0, wall_now_s - load.timestamp_s) if load.timestamp_s else 0.0
            out.append(RegistryEntry(info.worker_id, info.role, info.address, ep.info.transfer_address, load, age_s))
        return tuple(out)

    def alive(self) -> list[tuple[ipb.WorkerInfo, ipb.WorkerLoad]]:
        """Alive workers known here as wire messages (the Registry/Workers RPC)."""
        with self._lock:
            known = dict(self._endpoints)
        out = []
        for info, load in self.index.workers():
            if info.worker_id in known:
                public = ipb.WorkerInfo()
                public.CopyFrom(known[info.worker_id].info)
                public.ClearField("instance_id")  # the secret binding the id to its process
                out.append((public, load_to_proto(load)))
        return out
