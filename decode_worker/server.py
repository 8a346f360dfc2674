"""The decode worker: gRPC ``Decode`` service over a ``DecodeScheduler``, as an embeddable
service (``build(config)``, see ``runtime.service``) and as a process (``serve``).

Reserve -> (KV arrives through the transfer receiver) -> Decode (stream) -> done/Release.
The Conductor renews the reservations it holds until their Decode call (``Renew``); one whose
Decode call never comes (its Conductor died) expires; a Decode stream whose client goes away
is cancelled and its cache freed. Only the Conductor this worker registered with may call
Reserve, Decode, Release and Renew (``NEEDS``, ``runtime.auth``); any member may read Stats.
"""

from __future__ import annotations

import logging

import grpc

from decode_worker.config import DecodeConfig
from decode_worker.metrics import DecodeMetrics
from decode_worker.scheduler import DecodeScheduler, take_ready
from decode_worker.sink import expected_for, sink_for
from kvstore.transfer.base import TransferConfig, TransferError
from kvstore.transfer.receiver import Receiver
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from proto.convert import sampling_from_proto
from runtime.auth import Need
from runtime.errors import Refusal
from runtime.grpc_server import start_server
from runtime.metrics import Identity, start_metrics
from runtime.ranks import exit_now, serve_rank
from runtime.service import WorkerServiceBase, serve_until_signal
from runtime.settings import parse_config, setup_torch

log = logging.getLogger(__name__)

NEEDS = {"/tidekv.v1.Decode/Reserve": Need.SESSION, "/tidekv.v1.Decode/Decode": Need.SESSION,
         "/tidekv.v1.Decode/Release": Need.SESSION, "/tidekv.v1.Decode/Renew": Need.SESSION,
         "/tidekv.v1.Decode/Stats": Need.MEMBER}
MAX_RENEW_IDS = 65536  # ids in one Renew (a Conductor sends those it holds on this worker)
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
          "cancelled": pb.FINISH_REASON_CANCELLED, "failed": pb.FINISH_REASON_FAILED}


class DecodeService(igrpc.DecodeServicer):
    def __init__(self, scheduler: DecodeScheduler, receiver: Receiver, transfer_deadline_s: float):
        self.scheduler = scheduler
        self.receiver = receiver
        self.transfer_deadline_s = transfer_deadline_s

    def Reserve(self, request: ipb.ReserveRequest, context: grpc.ServicerContext) -> ipb.ReserveResponse:
        n = request.prompt_tokens + request.max_tokens
        try:
            seq = self.scheduler.try_reserve(request.request_id, n)
        except Refusal as e:  # Conflict: the id holds a reservation here already
            e.abort(context)
        if seq is None and self.scheduler.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining for shutdown")
        if seq is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"decode cache full: {n} tokens need {self.scheduler.cache.pages_for(n)} pages, "
                          f"{self.scheduler.cache.pool.num_free} free")
        deadline = request.deadline_s or self.transfer_deadline_s
        self.receiver.expect(request.request_id, sink_for(self.scheduler.cache, seq),
                             expected_for(self.scheduler.cache, request.prompt_tokens), deadline)
        return ipb.ReserveResponse(transfer_address=self.receiver.address, ttl_s=self.scheduler.reservation_ttl_s)

    def Decode(self, request: ipb.DecodeRequest, context: grpc.ServicerContext):
        rid = request.request_id
        try:
            self.receiver.wait_complete(rid, self.transfer_deadline_s)
        except TransferError as e:
            self.scheduler.release(rid)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer for {rid} failed: {e}")
        params = sampling_from_proto(request.sampling)
        try:
            out = self.scheduler.start_decoding(rid, request.prompt_tokens, request.first_token, params)
        except Refusal as e:  # NoReservation: it expired or was released meanwhile
            e.abort(context)
        context.add_callback(lambda: self.scheduler.release(rid))
        while True:
            # Every token queued so far goes in one message (the terminal rides on the last):
            # one token a message while the Conductor keeps up, a batch once it falls behind.
            ready = take_ready(out, timeout_s=1.0)
            if ready is None:
                if not context.is_active():
                    self.scheduler.release(rid)
                continue
            tokens, finished = ready
            if finished is not None:
                yield ipb.DecodeResponse(token_ids=tokens, finish_reason=FINISH[finished.reason])
                return
            yield ipb.DecodeResponse(token_ids=tokens)

    def Release(self, request: ipb.ReleaseRequest, context: grpc.ServicerContext) -> ipb.ReleaseResponse:
        self.receiver.cancel(request.request_id)
        return ipb.ReleaseResponse(released=self.scheduler.release(request.request_id))

    def Renew(self, request: ipb.RenewRequest, context: grpc.ServicerContext) -> ipb.RenewResponse:
        if len(request.request_ids) > MAX_RENEW_IDS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request_ids: {len(request.request_ids)} ids, at most {MAX_RENEW_IDS} per call")
        return ipb.RenewResponse(unknown_ids=self.scheduler.renew(list(request.request_ids)))

    def Stats(self, request: ipb.StatsRequest, context: grpc.ServicerContext) -> ipb.WorkerStats:
        load = self.scheduler.load()
        return ipb.WorkerStats(num_free_pages=load.num_free_pages, num_pages_total=self.scheduler.cache.pool.num_pages,
                               num_live_requests=len(load.request_ids))


class DecodeWorker(WorkerServiceBase):
    """The decode worker as an embeddable ``runtime.service.Service``: built from its config,
    it installs no signal handler and reads no environment; torch's process-wide settings
    (threads, denormals) are the embedding process's (``runtime.settings.setup_torch``)."""

    role = "decode"

    def __init__(self, config: DecodeConfig):
        super().__init__(config)
        self._scheduler: DecodeScheduler | None = None
        self._listening = False

    def _start(self) -> None:
        cfg = self.config
        ident = Identity(self.worker_id, "decode", cfg.model)
        self.metrics = start_metrics(cfg.host, cfg.metrics_port, identity=ident, advertise_host=cfg.advertised_host,
                                     tls=cfg.tls)
        self._closing.callback(self.metrics.stop)
        model = self._load_model()
        # --tls: KV frames on tcp transfer links are encrypted too (the peers' setting is the same)
        receiver = Receiver(TransferConfig(deadline_s=cfg.transfer_deadline_s, bind_host=cfg.host,
                                           advertise_host=cfg.advertised_host,
                                           auth_key=self.credential.transfer_key, encrypt=cfg.tls.serves),
                            backends=cfg.transfer_backend)
        self._closing.callback(receiver.close)
        self._scheduler = scheduler = DecodeScheduler(model, cfg.num_pages, cfg.num_slots, cfg.block_size,
                                                      cfg.max_batch, reservation_ttl_s=cfg.reservation_ttl_s,
                                                      metrics=DecodeMetrics(ident), transfers=receiver)
        self._listening, self._transfer_address = True, receiver.address
        scheduler.start()
        self._closing.callback(scheduler.stop)
        service = DecodeService(scheduler, receiver, cfg.transfer_deadline_s)
        self._running = start_server([lambda s: igrpc.add_DecodeServicer_to_server(service, s)],
                                     ["tidekv.v1.Decode"], cfg.host, cfg.port, advertise_host=cfg.advertised_host,
                                     interceptors=[self.credential.interceptor(NEEDS)], tls=cfg.tls)
        self._closing.callback(self._running.stop, 0)
        info = ipb.WorkerInfo(worker_id=self.worker_id, role=ipb.WORKER_ROLE_DECODE,
                              rpc_address=self._running.address, transfer_address=receiver.address,
                              model_fingerprint=model.fingerprint, block_size=cfg.block_size,
                              num_pages_total=cfg.num_pages, metrics_address=self.metrics.address)
        self._register(model, info, scheduler.load)

    def ready(self) -> bool:
        return (self._running is not None and self._listening and not self._draining
                and self._link is not None and self._link.registered)

    def drain(self, timeout_s: float) -> None:
        if self._running is None:
            return
        self._draining = True
        self._running.set_serving(False)
        assert self._scheduler is not None
        self._scheduler.drain(timeout_s)
        self._running.stop(timeout_s)

    def stop(self) -> None:
        self._listening = False
        super().stop()


def build(config: DecodeConfig) -> DecodeWorker:
    """The decode worker of ``config``, not started (``ValueError`` without a Conductor address)."""
    return DecodeWorker(config)


def serve(argv: list[str] | None = None) -> None:
    """``tidekv serve --role decode``: flags and ``TIDEKV_*`` -> build -> serve until SIGTERM/SIGINT."""
    cfg = parse_config(DecodeConfig, argv, prog="tidekv serve --role decode")
    if cfg.rank > 0:  # a rank of a parallel instance other than its face: no service of its own
        serve_rank(cfg)
        exit_now(0)  # the group is left; the interpreter's finalization could abort under gloo's threads
    try:
        worker = build(cfg)
    except ValueError as e:
        raise SystemExit(f"tidekv decode worker: {e}") from e
    setup_torch(cfg.threads or None)

    def announce(w: DecodeWorker) -> None:
        metrics = f", metrics on {w.metrics.address}" if w.metrics.address else ""
        print(f"tidekv decode worker {w.worker_id} serving on {w.address}{metrics}", flush=True)

    serve_until_signal(worker, cfg.drain_timeout_s, announce)
