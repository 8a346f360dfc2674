"""The decode worker process: gRPC ``Decode`` service over a ``DecodeScheduler``.

Reserve -> (KV arrives through the transfer receiver) -> Decode (stream) -> done/Release.
A reservation whose Decode call never comes expires; a Decode stream whose client goes away
is cancelled and its cache freed.
"""

from __future__ import annotations

import argparse
import logging
import queue
import uuid

import grpc

import engine
from decode_worker.scheduler import DecodeScheduler, Finished
from decode_worker.sink import expected_for, sink_for
from deploy.grpc_server import serve_until_signal, start_server
from deploy.settings import setup_torch, worker_parser
from deploy.worker_link import WorkerLink
from kvstore.transfer.base import TransferConfig, TransferError
from kvstore.transfer.receiver import Receiver
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from proto.convert import sampling_from_proto

log = logging.getLogger(__name__)

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
        except ValueError as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        if seq is None and self.scheduler.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining for shutdown")
        if seq is None:
            load = self.scheduler.load()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"decode cache full: {n} tokens need {self.scheduler.cache.pages_for(n)} pages, "
                          f"{load['num_free_pages']} free")
        deadline = request.deadline_s or self.transfer_deadline_s
        self.receiver.expect(request.request_id, sink_for(self.scheduler.cache, seq),
                             expected_for(self.scheduler.cache, request.prompt_tokens), deadline)
        return ipb.ReserveResponse(transfer_address=self.receiver.address)

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
        except ValueError as e:  # the reservation expired or was released meanwhile
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        context.add_callback(lambda: self.scheduler.release(rid))
        while True:
            try:
                item = out.get(timeout=1.0)
            except queue.Empty:
                if not context.is_active():
                    self.scheduler.release(rid)
                continue
            if isinstance(item, Finished):
                yield ipb.DecodeResponse(finish_reason=FINISH[item.reason])
                return
            yield ipb.DecodeResponse(token_ids=item)

    def Release(self, request: ipb.ReleaseRequest, context: grpc.ServicerContext) -> ipb.ReleaseResponse:
        self.receiver.cancel(request.request_id)
        return ipb.ReleaseResponse(released=self.scheduler.release(request.request_id))

    def Stats(self, request: ipb.StatsRequest, context: grpc.ServicerContext) -> ipb.WorkerStats:
        load = self.scheduler.load()
        return ipb.WorkerStats(num_free_pages=load["num_free_pages"], num_pages_total=load["num_pages_total"],
                               num_live_requests=load["num_running"] + load["num_reserved"] + load["queue_len"])


def build_parser() -> argparse.ArgumentParser:
    p = worker_parser("decode", num_pages=2048)
    p.add_argument("--num-slots", type=int, default=64, help="KDA state slots: most requests held at once")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--transfer-deadline-s", type=float, default=60.0)
    return p


def serve(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_torch(args.threads or None)
    model = engine.load_model(args.model, device=args.device)
    scheduler = DecodeScheduler(model, args.num_pages, args.num_slots, args.block_size, args.max_batch)
    receiver = Receiver(TransferConfig(deadline_s=args.transfer_deadline_s, bind_host=args.host),
                        backends=args.transfer_backend)
    service = DecodeService(scheduler, receiver, args.transfer_deadline_s)
    running = start_server([lambda s: igrpc.add_DecodeServicer_to_server(service, s)],
                           ["tidekv.v1.Decode"], args.host, args.port)
    worker_id = args.worker_id or f"decode-{uuid.uuid4().hex[:6]}"
    info = ipb.WorkerInfo(worker_id=worker_id, role=ipb.WORKER_ROLE_DECODE, rpc_address=running.address,
                          transfer_address=receiver.address, model_fingerprint=model.fingerprint,
                          block_size=args.block_size, num_pages_total=args.num_pages)

    def load() -> ipb.WorkerLoad:
        s = scheduler.load()
        return ipb.WorkerLoad(queue_len=s["queue_len"], num_running_requests=s["num_running"],
                              num_free_pages=s["num_free_pages"], num_tokens_in_flight=s["num_tokens_in_flight"])

    link = WorkerLink(args.conductor, info, load)
    scheduler.start()
    link.start()
    print(f"tidekv decode worker {worker_id} serving on {running.address}", flush=True)
    serve_until_signal(running, on_stop=lambda: (link.stop(), scheduler.stop(), receiver.close()),
                       drain=scheduler.drain)
