"""The Conductor's view of the cluster: the global index, worker addresses and stubs, and the
``ClusterSnapshot`` a routing policy decides on.

Owns the registry side of the Conductor: registration checks (one model, one block size),
heartbeats into the index, block events into the index, and gRPC stubs per worker.
Thread-safe: the index is; the local maps are guarded by one lock.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from conductor.routing import ClusterSnapshot, WorkerView
from deploy.grpc_server import channel
from kvstore.blocks import BlockKey, Tier
from kvstore.index import BlockEvent, GlobalIndex, WorkerInfo, WorkerLoad, WorkerRole
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc

log = logging.getLogger(__name__)

ROLE = {ipb.WORKER_ROLE_PREFILL: WorkerRole.PREFILL, ipb.WORKER_ROLE_DECODE: WorkerRole.DECODE}


@dataclass(frozen=True)
class Endpoint:
    info: ipb.WorkerInfo
    prefill: igrpc.PrefillStub | None
    decode: igrpc.DecodeStub | None


class Cluster:
    def __init__(self, index: GlobalIndex):
        self.index = index
        self._lock = threading.Lock()
        self._endpoints: dict[str, Endpoint] = {}
        self.model_fingerprint: str | None = None
        self.block_size: int | None = None

    # ---- registry -----------------------------------------------------------------------------
    def register(self, info: ipb.WorkerInfo) -> str | None:
        """None when accepted, else the reason for refusing the worker."""
        if info.role not in ROLE:
            return f"worker {info.worker_id}: role must be prefill or decode"
        with self._lock:
            if self.model_fingerprint is None:
                self.model_fingerprint, self.block_size = info.model_fingerprint, info.block_size
            if info.model_fingerprint != self.model_fingerprint or info.block_size != self.block_size:
                return (f"worker {info.worker_id} serves model {info.model_fingerprint} with block size "
                        f"{info.block_size}; this cluster serves {self.model_fingerprint} with {self.block_size}")
            ch = channel(info.rpc_address)
            is_prefill = info.role == ipb.WORKER_ROLE_PREFILL
            self._endpoints[info.worker_id] = Endpoint(
                info, igrpc.PrefillStub(ch) if is_prefill else None, None if is_prefill else igrpc.DecodeStub(ch))
        self.index.register(WorkerInfo(info.worker_id, ROLE[info.role], info.rpc_address, info.num_pages_total,
                                       info.dram_capacity_bytes, info.ssd_capacity_bytes))
        log.info("registered %s %s at %s", ROLE[info.role], info.worker_id, info.rpc_address)
        return None

    def heartbeat(self, worker_id: str, load: ipb.WorkerLoad, events: list[ipb.BlockEvent]) -> bool:
        """False when this Conductor does not know the worker (it must register again)."""
        with self._lock:
            if worker_id not in self._endpoints:
                return False
        alive = self.index.heartbeat(worker_id, WorkerLoad(
            load.queue_len, load.num_running_requests, load.num_free_pages, load.free_dram_bytes,
            load.num_tokens_in_flight))
        if alive:
            self.apply_events(worker_id, events)
        return alive

    def apply_events(self, worker_id: str, events: list[ipb.BlockEvent]) -> None:
        if events:
            self.index.apply([
                BlockEvent.removed(worker_id, e.key) if e.tier < 0
                else BlockEvent.stored(worker_id, e.key, Tier(e.tier), e.has_snapshot)
                for e in events
            ])

    def alive(self) -> list[tuple[ipb.WorkerInfo, ipb.WorkerLoad]]:
        with self._lock:
            known = dict(self._endpoints)
        return [
            (known[info.worker_id].info, ipb.WorkerLoad(
                queue_len=load.queue_len, num_running_requests=load.num_running_requests,
                num_free_pages=load.num_free_pages, free_dram_bytes=load.free_dram_bytes,
                num_tokens_in_flight=load.num_tokens_in_flight))
            for info, load in self.index.workers() if info.worker_id in known
        ]

    def endpoint(self, worker_id: str) -> Endpoint:
        with self._lock:
            return self._endpoints[worker_id]

    # ---- snapshot -------------------------------------------------------------------------------
    def snapshot(self, keys: list[BlockKey], now_s: float) -> ClusterSnapshot:
        """Alive workers known here, with each prefill worker's usable prefix of ``keys``."""
        matches = self.index.match(keys) if keys else None
        with self._lock:
            known = dict(self._endpoints)
        prefill, decode = [], []
        for info, load in self.index.workers():
            ep = known.get(info.worker_id)
            if ep is None:
                continue
            m = matches.get(info.worker_id) if matches is not None else None
            usable = m.num_blocks_usable if m is not None else 0
            view = WorkerView(
                worker_id=info.worker_id, role=str(info.role), rpc_address=info.address,
                transfer_address=ep.info.transfer_address, queue_len=load.queue_len,
                num_running=load.num_running_requests, num_free_pages=load.num_free_pages,
                num_tokens_in_flight=load.num_tokens_in_flight, usable_blocks=usable,
                usable_tier=int(m.slowest_usable_tier) if usable and m.slowest_usable_tier is not None else None,
            )
            (prefill if info.role == WorkerRole.PREFILL else decode).append(view)
        return ClusterSnapshot(tuple(prefill), tuple(decode), now_s)
