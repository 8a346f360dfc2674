"""The prefill worker: gRPC ``Prefill`` service over a ``PrefillRunner`` and its store, as an
embeddable service (``build(config)``, see ``runtime.service``) and as a process (``serve``).

Block events of the store (stored / moved / removed) are queued; a Prefill response carries
the ones produced up to its end so the Conductor publishes them before the next request
routes, and heartbeats carry the rest (evictions between requests). Only the Conductor this
worker registered with may call Prefill; PushBlocks serves a member only with the
Conductor's grant for exactly that pull (``runtime.auth``); any member may read Stats.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading

import grpc

from kvstore.device import DeviceTier
from kvstore.metrics import StoreMetrics
from kvstore.store import StoreConfig, StoreEvent, TieredStore
from kvstore.transfer.base import FaultInjection, TransferConfig, TransferError
from prefill_worker.config import PrefillConfig
from prefill_worker.metrics import PrefillMetrics
from prefill_worker.runner import Cancelled, PrefillRunner
from prefill_worker.transfers import TransferHub
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from proto.convert import block_event, prefill_call_from_proto, prefill_result_to_proto
from runtime.auth import AuthError, Need, WorkerCredential, check_grant, current_principal, refuse, worker_of
from runtime.errors import Refusal
from runtime.grpc_server import start_server
from runtime.metrics import Identity, start_metrics
from runtime.ranks import exit_now, remove_when_failing, serve_rank
from runtime.service import WorkerServiceBase, serve_until_signal
from runtime.settings import parse_config, setup_torch

log = logging.getLogger(__name__)


NEEDS = {"/tidekv.v1.Prefill/Prefill": Need.SESSION, "/tidekv.v1.Prefill/PushBlocks": Need.MEMBER,
         "/tidekv.v1.Prefill/Stats": Need.MEMBER}


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
    def __init__(self, runner: PrefillRunner, hub: TransferHub, events: EventQueue, credential: WorkerCredential):
        self.runner, self.hub, self.events, self.credential = runner, hub, events, credential

    def Prefill(self, request: ipb.PrefillRequest, context: grpc.ServicerContext) -> ipb.PrefillResponse:
        job = prefill_call_from_proto(request, default_deadline_s=60.0)
        try:
            out = self.runner.run(job, lambda: not context.is_active())
        except Refusal as e:  # Busy is NoRoom; anything not typed is a bug of ours: UNKNOWN, not the caller's
            e.abort(context)
        except Cancelled as e:
            context.abort(grpc.StatusCode.CANCELLED, str(e))
        except TransferError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer to decode worker failed: {e}")
        return prefill_result_to_proto(out, self.events.drain())

    def PushBlocks(self, request: ipb.PushBlocksRequest, context: grpc.ServicerContext) -> ipb.PushBlocksResponse:
        keys = list(request.block_keys)
        puller = worker_of(current_principal(context)) or ""
        try:
            check_grant(self.credential.session_key, request.grant, request.grant_expiry_ms, request.request_id,
                        puller, request.dest_transfer_address, keys)
        except AuthError as e:
            refuse(context, e, f"PushBlocks of {len(keys)} blocks by {puller or 'a non-worker'}")
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
        return ipb.WorkerStats(num_free_pages=self.runner.free_pages(), num_pages_total=cache.pool.num_pages,
                               num_live_requests=len(cache.live), num_blocks_stored=self._num_blocks())

    def _num_blocks(self) -> int:
        store = self.runner.store
        return sum(len(store.keys(t)) for t in store.tiers)


class PrefillWorker(WorkerServiceBase):
    """The prefill worker as an embeddable ``runtime.service.Service``: built from its config,
    it installs no signal handler and reads no environment; torch's process-wide settings
    (threads, denormals) are the embedding process's (``runtime.settings.setup_torch``)."""

    role = "prefill"

    def __init__(self, config: PrefillConfig):
        super().__init__(config)
        self.data_dir = config.data_dir
        self._runner: PrefillRunner | None = None

    def _start(self) -> None:
        cfg = self.config
        ident = Identity(self.worker_id, "prefill", cfg.model)
        self.metrics = start_metrics(cfg.host, cfg.metrics_port, identity=ident, advertise_host=cfg.advertised_host,
                                     tls=cfg.tls)
        self._closing.callback(self.metrics.stop)
        model = self._load_model()
        mcfg = model.cfg
        state_bytes = mcfg.kda_num_heads * mcfg.kda_head_dim**2 * 4  # one KDA layer's state: one frame
        if cfg.max_frame_bytes < state_bytes:
            raise ValueError(f"--max-frame-bytes {cfg.max_frame_bytes} is below one KDA state ({state_bytes} bytes)")
        if not self.data_dir:
            self.data_dir = tempfile.mkdtemp(prefix=f"tidekv-{self.worker_id}-")
            self._closing.callback(shutil.rmtree, self.data_dir, ignore_errors=True)
            remove_when_failing(self.data_dir)  # a lost rank ends this process without the closers
        events = EventQueue()
        cache = model.new_cache(cfg.num_pages, num_slots=2, block_size=cfg.block_size)
        device = None
        if cfg.device_bytes:
            device = DeviceTier(cache.pool, cfg.device_bytes, model.fingerprint, mcfg.mla_layer_ids,
                                mcfg.kda_layer_ids)
        store = TieredStore(StoreConfig(model_fingerprint=model.fingerprint, dram_capacity_bytes=cfg.dram_bytes,
                                        ssd_capacity_bytes=cfg.ssd_bytes, ssd_dir=f"{self.data_dir}/ssd",
                                        eviction_policy=cfg.eviction,
                                        snapshot_interval_blocks=cfg.snapshot_interval_blocks),
                            device=device, on_event=events.on_event, metrics=StoreMetrics(ident))
        self._closing.callback(store.close)
        faults = FaultInjection(corrupt_seq=cfg.fault_corrupt_frame) if cfg.fault_corrupt_frame else None
        # --tls: KV frames on tcp transfer links are encrypted too (the peers' setting is the same)
        hub = TransferHub(TransferConfig(bind_host=cfg.host, advertise_host=cfg.advertised_host,
                                         max_frame_bytes=cfg.max_frame_bytes,
                                         auth_key=self.credential.transfer_key, encrypt=cfg.tls.serves),
                          cfg.transfer_backend, member=self.credential.member, faults=faults)
        self._closing.callback(hub.close)
        self._transfer_address = hub.address
        self._runner = runner = PrefillRunner(model, store, hub, cache, cfg.snapshot_interval_blocks,
                                              metrics=PrefillMetrics(ident))
        service = PrefillService(runner, hub, events, self.credential)
        self._running = start_server([lambda s: igrpc.add_PrefillServicer_to_server(service, s)],
                                     ["tidekv.v1.Prefill"], cfg.host, cfg.port, advertise_host=cfg.advertised_host,
                                     interceptors=[self.credential.interceptor(NEEDS)], tls=cfg.tls)
        self._closing.callback(self._running.stop, 0)
        info = ipb.WorkerInfo(worker_id=self.worker_id, role=ipb.WORKER_ROLE_PREFILL,
                              rpc_address=self._running.address, transfer_address=hub.address,
                              model_fingerprint=model.fingerprint, block_size=cfg.block_size,
                              num_pages_total=cfg.num_pages, dram_capacity_bytes=cfg.dram_bytes,
                              ssd_capacity_bytes=cfg.ssd_bytes, metrics_address=self.metrics.address)

        def all_blocks() -> list[ipb.BlockEvent]:
            return [block_event(k, t, store.has_snapshot(k)) for t in store.tiers for k in store.keys(t)]

        self._register(model, info, runner.load, all_blocks=all_blocks, drain_events=events.drain)

    def ready(self) -> bool:
        return self._running is not None and not self._draining and self._link is not None and self._link.registered

    def drain(self, timeout_s: float) -> None:
        if self._running is None:
            return
        self._draining = True
        self._running.set_serving(False)
        assert self._runner is not None
        self._runner.drain(timeout_s)
        self._running.stop(timeout_s)



def build(config: PrefillConfig) -> PrefillWorker:
    """The prefill worker of ``config``, not started (``ValueError`` without a Conductor address)."""
    return PrefillWorker(config)


def serve(argv: list[str] | None = None) -> None:
    """``tidekv serve --role prefill``: flags and ``TIDEKV_*`` -> build -> serve until SIGTERM/SIGINT."""
    cfg = parse_config(PrefillConfig, argv, prog="tidekv serve --role prefill")
    if cfg.rank > 0:  # a rank of a parallel instance other than its face: no service of its own
        serve_rank(cfg)
        exit_now(0)  # the group is left; the interpreter's finalization could abort under gloo's threads
    try:
        worker = build(cfg)
    except ValueError as e:
        raise SystemExit(f"tidekv prefill worker: {e}") from e
    setup_torch(cfg.threads or None)

    def announce(w: PrefillWorker) -> None:
        metrics = f", metrics on {w.metrics.address}" if w.metrics.address else ""
        print(f"tidekv prefill worker {w.worker_id} serving on {w.address} (data {w.data_dir}{metrics})", flush=True)

    serve_until_signal(worker, cfg.drain_timeout_s, announce)
