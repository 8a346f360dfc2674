"""The prefill worker process: gRPC ``Prefill`` service over a ``PrefillRunner`` and its store.

Block events of the store (stored / moved / removed) are queued; a Prefill response carries
the ones produced up to its end so the Conductor publishes them before the next request
routes, and heartbeats carry the rest (evictions between requests).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import uuid

import grpc

import engine
from kvstore.store import StoreConfig, StoreEvent, TieredStore
from kvstore.transfer.base import TransferConfig, TransferError
from prefill_worker.config import PrefillConfig
from prefill_worker.runner import Busy, Cancelled, PrefillJob, PrefillRunner
from prefill_worker.transfers import TransferHub
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from proto.convert import block_event, sampling_from_proto
from runtime.grpc_server import serve_until_signal, start_server
from runtime.settings import parse_config, setup_torch
from runtime.worker_link import WorkerLink

log = logging.getLogger(__name__)


class EventQueue:
    """Store events waiting to be published; filled by the store, drained by RPCs. Thread-safe."""

    def __init__(self) -> None:
        self._events: list[ipb.BlockEvent] = []
        self._lock = threading.Lock()

    def on_event(self, e: StoreEvent) -> None:
        with self._lock:
            self._events.append(block_event(e.key, None if e.kind == "removed" else e.tier, e.has_snapshot))

    def drain(self) -> list[ipb.BlockEvent]:
        with self._lock:
            out, self._events = self._events, []
            return out


class PrefillService(igrpc.PrefillServicer):
    def __init__(self, runner: PrefillRunner, hub: TransferHub, events: EventQueue):
        self.runner, self.hub, self.events = runner, hub, events

    def Prefill(self, request: ipb.PrefillRequest, context: grpc.ServicerContext) -> ipb.PrefillResponse:
        job = PrefillJob(
            request_id=request.request_id, token_ids=tuple(request.token_ids),
            params=sampling_from_proto(request.sampling), block_keys=tuple(request.block_keys),
            reuse_blocks=request.reuse.num_blocks, holder_rpc_address=request.reuse.holder_rpc_address,
            decode_address=request.decode_transfer_address, deadline_s=request.deadline_s or 60.0,
        )
        try:
            out = self.runner.run(job, lambda: not context.is_active())
        except Busy as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Cancelled as e:
            context.abort(grpc.StatusCode.CANCELLED, str(e))
        except TransferError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer to decode worker failed: {e}")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return ipb.PrefillResponse(first_token=out.first_token, cached_tokens=out.cached_tokens,
                                   prefill_s=out.prefill_s, events=self.events.drain())

    def PushBlocks(self, request: ipb.PushBlocksRequest, context: grpc.ServicerContext) -> ipb.PushBlocksResponse:
        keys = list(request.block_keys)
        store = self.runner.store
        if not store.pin(keys):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "some requested blocks are no longer held here")
        try:
            blobs = [store.try_get_encoded(k) for k in keys]
            missing = sum(b is None for b in blobs)
            if missing:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{missing} of {len(keys)} blocks not held here")
            self.hub.push_blobs(request.transfer_id, request.dest_transfer_address, blobs)
        except TransferError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"pushing blocks failed: {e}")
        finally:
            store.unpin(keys)
        return ipb.PushBlocksResponse(num_blocks=len(keys))

    def Stats(self, request: ipb.StatsRequest, context: grpc.ServicerContext) -> ipb.WorkerStats:
        cache = self.runner.cache
        return ipb.WorkerStats(num_free_pages=cache.pool.num_free, num_pages_total=cache.pool.num_pages,
                               num_live_requests=len(cache.live), num_blocks_stored=self._num_blocks())

    def _num_blocks(self) -> int:
        store = self.runner.store
        return sum(len(store.keys(t)) for t in store.tiers)


def serve(argv: list[str] | None = None) -> None:
    cfg = parse_config(PrefillConfig, argv, prog="tidekv serve --role prefill")
    cfg.require_conductor()
    setup_torch(cfg.threads or None)
    model = engine.load_model(cfg.model, device=cfg.device)
    mcfg = model.cfg
    state_bytes = mcfg.kda_num_heads * mcfg.kda_head_dim**2 * 4  # one KDA layer's state: one frame
    if cfg.max_frame_bytes < state_bytes:
        raise ValueError(f"--max-frame-bytes {cfg.max_frame_bytes} is below one KDA state ({state_bytes} bytes)")
    worker_id = cfg.worker_id or f"prefill-{uuid.uuid4().hex[:6]}"
    data_dir = cfg.data_dir or tempfile.mkdtemp(prefix=f"tidekv-{worker_id}-")
    events = EventQueue()
    store = TieredStore(StoreConfig(model_fingerprint=model.fingerprint, dram_capacity_bytes=cfg.dram_bytes,
                                    ssd_capacity_bytes=cfg.ssd_bytes, ssd_dir=f"{data_dir}/ssd",
                                    eviction_policy=cfg.eviction,
                                    snapshot_interval_blocks=cfg.snapshot_interval_blocks),
                        on_event=events.on_event)
    hub = TransferHub(TransferConfig(bind_host=cfg.host, advertise_host=cfg.advertised_host,
                                     max_frame_bytes=cfg.max_frame_bytes), cfg.transfer_backend)
    runner = PrefillRunner(model, store, hub, cfg.num_pages, cfg.block_size, cfg.snapshot_interval_blocks)
    service = PrefillService(runner, hub, events)
    running = start_server([lambda s: igrpc.add_PrefillServicer_to_server(service, s)],
                           ["tidekv.v1.Prefill"], cfg.host, cfg.port, advertise_host=cfg.advertised_host)
    info = ipb.WorkerInfo(worker_id=worker_id, role=ipb.WORKER_ROLE_PREFILL, rpc_address=running.address,
                          transfer_address=hub.address, model_fingerprint=model.fingerprint,
                          block_size=cfg.block_size, num_pages_total=cfg.num_pages,
                          dram_capacity_bytes=cfg.dram_bytes, ssd_capacity_bytes=cfg.ssd_bytes)

    def all_blocks() -> list[ipb.BlockEvent]:
        return [block_event(k, t, store.has_snapshot(k)) for t in store.tiers for k in store.keys(t)]

    link = WorkerLink(cfg.conductor, info, runner.load, all_blocks, drain_events=events.drain)
    link.start()
    print(f"tidekv prefill worker {worker_id} serving on {running.address} (data {data_dir})", flush=True)
    serve_until_signal(running, grace_s=cfg.drain_timeout_s,
                       on_stop=lambda: (link.stop(), hub.close(), store.close()), drain=runner.drain)
