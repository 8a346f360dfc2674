"""The Conductor process: public ``Inference`` service, internal ``Registry`` service.

Generate = validate (INVALID_ARGUMENT naming the field) -> admission (RESOURCE_EXHAUSTED at
once when the queue is full) -> ``RequestLife.run`` (route, reserve, prefill, decode).
The index is in memory by default or in Redis with ``--index redis://...`` (falling back to
local knowledge while Redis is unreachable).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import threading
from collections import Counter

import grpc

import engine
from conductor.admission import Admission, AdmissionConfig
from conductor.cluster import Cluster
from conductor.lifecycle import Refused, RequestLife
from conductor.routing import get_policy, policy_names
from conductor.validation import Limits, validate
from deploy.grpc_server import serve_until_signal, start_server
from kvstore.index import GlobalIndex
from kvstore.index_memory import MemoryIndex
from proto import inference_pb2 as pb
from proto import inference_pb2_grpc as pgrpc
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc

log = logging.getLogger(__name__)


class InferenceService(pgrpc.InferenceServicer):
    def __init__(self, cluster: Cluster, model: str, policy: str, admission: Admission, limits: Limits):
        self.cluster = cluster
        self.cfg = engine.load_config(model)
        self.tokenizer = engine.load_tokenizer(model)
        self.policy = get_policy(policy)
        self.admission = admission
        self.limits = limits
        self._seq = itertools.count()
        self.outcomes: Counter[str] = Counter()  # terminal outcomes, for tests and metrics
        self._lock = threading.Lock()

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] += 1

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        try:
            valid = validate(request, self.cfg, self.tokenizer, self.limits)
        except ValueError as e:
            self._count("invalid")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        refusal = self.admission.try_enter(timeout_s=min(valid.deadline_s, 30.0))
        if refusal is not None:
            self._count("rejected")
            context.set_trailing_metadata((("retry-after-s", "1"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        life = RequestLife(self.cluster, self.policy, self.tokenizer, valid, request.request_id,
                           next(self._seq), request.sampling)
        context.add_callback(life.cancel)
        try:
            for msg in life.run():
                if msg.finish_reason:
                    self._count(pb.FinishReason.Name(msg.finish_reason))
                yield msg
        except Refused as e:
            self._count("rejected")
            context.set_trailing_metadata((("retry-after-s", f"{e.retry_after_s:g}"),))
            context.abort(e.code, str(e))
        finally:
            if life.cancelled:
                self._count("client_cancelled")
            self.admission.leave()


class RegistryService(igrpc.RegistryServicer):
    def __init__(self, cluster: Cluster, heartbeat_interval_s: float):
        self.cluster = cluster
        self.heartbeat_interval_s = heartbeat_interval_s

    def Register(self, request: ipb.RegisterRequest, context: grpc.ServicerContext) -> ipb.RegisterResponse:
        reason = self.cluster.register(request.info)
        return ipb.RegisterResponse(accepted=reason is None, reason=reason or "",
                                    heartbeat_interval_s=self.heartbeat_interval_s)

    def Heartbeat(self, request: ipb.HeartbeatRequest, context: grpc.ServicerContext) -> ipb.HeartbeatResponse:
        return ipb.HeartbeatResponse(known=self.cluster.heartbeat(request.worker_id, request.load,
                                                                  list(request.events)))

    def Workers(self, request: ipb.WorkersRequest, context: grpc.ServicerContext) -> ipb.WorkersResponse:
        resp = ipb.WorkersResponse()
        for info, load in self.cluster.alive():
            resp.workers.append(info)
            resp.loads.append(load)
        return resp


def make_index(url: str, ttl_s: float) -> GlobalIndex:
    if url in ("", "memory"):
        return MemoryIndex(ttl_s=ttl_s)
    if url.startswith("redis://"):
        from kvstore.index_fallback import FallbackIndex
        from kvstore.index_redis import RedisIndex, RedisIndexConfig

        return FallbackIndex(RedisIndex(url, config=RedisIndexConfig(ttl_s=ttl_s)), MemoryIndex(ttl_s=ttl_s))
    raise ValueError(f"--index must be 'memory' or redis://HOST:PORT[/DB], got {url!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("tidekv serve --role conductor")
    p.add_argument("--model", default="tiny", help="model whose config and tokenizer the Conductor uses")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--policy", default="cache_aware", choices=policy_names())
    p.add_argument("--index", default="memory", help="memory (embedded) or redis://127.0.0.1:6379")
    p.add_argument("--worker-ttl-s", type=float, default=3.0)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-queued", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=8000)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    return p


def serve(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    index = make_index(args.index, args.worker_ttl_s)
    cluster = Cluster(index)
    admission = Admission(AdmissionConfig(args.max_running, args.max_queued))
    limits = Limits(max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens)
    inference = InferenceService(cluster, args.model, args.policy, admission, limits)
    registry = RegistryService(cluster, heartbeat_interval_s=0.5)
    running = start_server(
        [lambda s: pgrpc.add_InferenceServicer_to_server(inference, s),
         lambda s: igrpc.add_RegistryServicer_to_server(registry, s)],
        ["tidekv.v1.Inference", "tidekv.v1.Registry"], args.host, args.port,
        max_workers=args.max_running + args.max_queued + 32,
    )
    stop = threading.Event()

    def reap() -> None:
        while not stop.wait(args.worker_ttl_s):
            for worker_id in index.reap_expired():
                log.warning("worker %s stopped heartbeating; dropped with its blocks", worker_id)

    threading.Thread(target=reap, name="reaper", daemon=True).start()
    print(f"tidekv conductor serving on {running.address} (policy {args.policy}, index {args.index})", flush=True)
    serve_until_signal(running, on_stop=lambda: (stop.set(), index.close()))
