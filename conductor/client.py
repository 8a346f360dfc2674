"""A small client for the public ``Inference`` API, used by the CLI, the demo and benchmarks."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from proto import inference_pb2 as pb
from proto import inference_pb2_grpc as pgrpc
from runtime.grpc_server import TlsFiles, channel


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0  # measured by the client
    total_s: float = 0.0
    prefill_worker: str = ""
    decode_worker: str = ""
    pulled_from: str = ""  # the worker the prefix was pulled from ("" when none)
    route_branch: str = ""  # cold | local | pull | replicate
    predicted_ttft_s: float = 0.0
    num_terminal: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / (self.total_s - self.ttft_s) if n > 0 and self.total_s > self.ttft_s else 0.0


class _Bearer(grpc.UnaryStreamClientInterceptor):
    """Adds the API key to every Generate call (gRPC's own call credentials need TLS)."""

    def __init__(self, api_key: str):
        self._header = ("authorization", f"Bearer {api_key}")

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(details._replace(metadata=(*(details.metadata or ()), self._header)), request)


def public_channel(endpoint: str, api_key: str = "", tls_ca: str = "") -> grpc.Channel:
    """A channel to a Conductor's public endpoint: TLS verified against ``tls_ca`` when given,
    every call carrying ``authorization: Bearer <api_key>`` when given."""
    ch = channel(endpoint, TlsFiles(ca=tls_ca) if tls_ca else None)
    return grpc.intercept_channel(ch, _Bearer(api_key)) if api_key else ch


class Client:
    def __init__(self, endpoint: str, api_key: str = "", tls_ca: str = ""):
        self._channel = public_channel(endpoint, api_key, tls_ca)
        self.stub = pgrpc.InferenceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    @staticmethod
    def request(prompt: str | Sequence[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                top_k: int = 0, seed: int = 0, stop_token_ids: Sequence[int] = (), tenant: str = "",
                request_id: str = "", ttft_slo_s: float = 0.0, tbt_slo_s: float = 0.0) -> pb.GenerateRequest:
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                     seed=seed, stop_token_ids=list(stop_token_ids))
        common = dict(sampling=sampling, tenant=tenant, request_id=request_id, ttft_slo_s=ttft_slo_s,
                      tbt_slo_s=tbt_slo_s)
        if isinstance(prompt, str):
            return pb.GenerateRequest(text=prompt, **common)
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(prompt)), **common)

    def generate(self, req: pb.GenerateRequest, timeout_s: float = 300.0) -> Completion:
        """Runs one request to its end; raises grpc.RpcError for a refused request."""
        out = Completion()
        t0 = time.perf_counter()
        for msg in self.stub.Generate(req, timeout=timeout_s):
            if not out.token_ids and msg.token_ids:
                out.ttft_s = time.perf_counter() - t0
                out.prefill_worker, out.decode_worker = msg.prefill_worker, msg.decode_worker
                out.pulled_from, out.route_branch = msg.pulled_from, msg.route_branch
                out.request_id = msg.request_id
                out.cached_tokens, out.prompt_tokens = msg.usage.cached_tokens, msg.usage.prompt_tokens
            out.token_ids.extend(msg.token_ids)
            out.text += msg.text
            if msg.finish_reason:
                out.num_terminal += 1
                out.finish_reason = pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
                out.error = msg.error
                out.cached_tokens = msg.usage.cached_tokens
                out.prompt_tokens = msg.usage.prompt_tokens
                out.predicted_ttft_s = msg.timing.predicted_ttft_s
        out.total_s = time.perf_counter() - t0
        return out
