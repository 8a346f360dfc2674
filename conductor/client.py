"""A small client for the public ``Inference`` API, used by the CLI, the demo, replays and
benchmarks, that knows several Conductor replicas and fails over between them.

``Client(endpoints)`` takes one ``host:port`` or several (a list, or comma-separated): the
replicas of one cluster. A call that a replica cannot take (it is down or draining:
UNAVAILABLE, or its connection dropped) goes to the next one. A stream whose Conductor dies
mid-way is resumed on another replica (``GenerateRequest.resume``: the tokens already
received; the Conductor goes on after them token-exactly), so the caller sees one stream
(``ResumableCall``). Nothing that was refused for a reason of its own (invalid, over
capacity, past its deadline) is retried.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from proto import inference_pb2 as pb
from proto import inference_pb2_grpc as pgrpc
from runtime.grpc_server import channel
from runtime.tls import TlsFiles


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
    timing: pb.Timing = field(default_factory=pb.Timing)  # the Conductor's, from the terminal message

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


log = logging.getLogger(__name__)
MAX_FAILOVERS = 6  # replicas tried in a row for one call before its error is the caller's
FAILOVER_BACKOFF_S = 0.2  # before the n-th try: this x 2^(n-1), at most the max (about 7 s in all)
FAILOVER_BACKOFF_MAX_S = 2.0
# What gRPC says (with UNKNOWN or INTERNAL) when a server's connection drops mid-call.
_CONNECTION_LOST = ("stream removed", "socket closed", "connection reset", "failed to connect")


def is_failover(e: grpc.RpcError) -> bool:
    """Whether another replica should get the call: this one is down, draining or cut off (not
    a refusal the Conductor made for the request itself, which carries ``reject-reason``)."""
    code = e.code()
    trailers = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
    if "reject-reason" in trailers:
        return False
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    details = (e.details() or "").lower()
    return code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and any(m in details for m in _CONNECTION_LOST)


def split_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = [e.strip() for e in items if e.strip()]
    if not out:
        raise ValueError("a Conductor endpoint (host:port, or several comma-separated) is required")
    return out


class Client:
    """``endpoints``: one Conductor ``host:port``, or its replicas (a list or comma-separated)."""

    def __init__(self, endpoints: str | Sequence[str], api_key: str = "", tls_ca: str = "",
                 max_failovers: int = MAX_FAILOVERS):
        self.endpoints = split_endpoints(endpoints)
        self._channels = [public_channel(e, api_key, tls_ca) for e in self.endpoints]
        self._stubs = [pgrpc.InferenceStub(ch) for ch in self._channels]
        self._current = 0
        self.max_failovers = max_failovers
        self.num_failovers = 0  # calls moved to another replica, in all
        self.num_resumed = 0  # streams resumed on another replica mid-way

    @property
    def stub(self) -> pgrpc.InferenceStub:
        """The stub of the replica calls go to now."""
        return self._stubs[self._current]

    def failed_over(self, dead: pgrpc.InferenceStub) -> None:
        """The replica behind ``dead`` failed a call: the next calls go to the next one."""
        if dead is self._stubs[self._current] and len(self._stubs) > 1:
            self._current = (self._current + 1) % len(self._stubs)
        self.num_failovers += 1

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def stream(self, req: pb.GenerateRequest, timeout_s: float = 300.0) -> ResumableCall:
        """One request's messages, across failovers; ``cancel()`` ends it."""
        return ResumableCall(self, req, timeout_s)

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
        for msg in self.stream(req, timeout_s):
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
                out.timing = msg.timing
        out.total_s = time.perf_counter() - t0
        return out


class ResumableCall:
    """A ``Generate`` stream that survives its Conductor: when the replica fails, the call goes
    to the next one, and once tokens have arrived it resumes after them (``resume``); after the
    terminal message, nothing is resumed (so exactly one comes). Iterate it once; ``cancel``
    from any thread ends it (``grpc.RpcError`` CANCELLED, as a call's)."""

    def __init__(self, client: Client, req: pb.GenerateRequest, timeout_s: float):
        self.client, self.req, self.timeout_s = client, req, timeout_s
        self.num_resumed = 0
        self._call: grpc.Call | None = None
        self._cancelled = False
        self._lock = threading.Lock()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def __iter__(self) -> Iterator[pb.GenerateResponse]:
        until = time.monotonic() + self.timeout_s
        sent: list[int] = []
        failovers = 0
        while True:
            req = pb.GenerateRequest()
            req.CopyFrom(self.req)
            if failovers:
                req.failover = True
            if sent:
                req.resume.ids[:] = list(self.req.resume.ids) + sent
            stub = self.client.stub
            with self._lock:
                call = self._call = stub.Generate(req, timeout=max(0.001, until - time.monotonic()))
                if self._cancelled:
                    call.cancel()
            finished = False
            try:
                for msg in call:
                    sent.extend(msg.token_ids)
                    finished = finished or bool(msg.finish_reason)
                    yield msg
                return
            except grpc.RpcError as e:
                if finished:  # the terminal message came: a replica lost after it changes nothing
                    return
                if self._cancelled or not is_failover(e) or failovers >= self.client.max_failovers:
                    raise
                failovers += 1
                self.client.failed_over(stub)
                # A lone Conductor restarted by its supervisor comes back within seconds.
                time.sleep(min(FAILOVER_BACKOFF_MAX_S, FAILOVER_BACKOFF_S * 2 ** (failovers - 1),
                               max(0.0, until - time.monotonic())))
                if until - time.monotonic() < FAILOVER_BACKOFF_S:  # no time left for another try: this is
                    raise  # the call's end, and its cause the failure, not the deadline a retry would hit
                if sent:
                    self.num_resumed += 1
                    self.client.num_resumed += 1
                log.warning("the Conductor failed the call (%s: %s); %s on %s", e.code().name, e.details(),
                            f"resuming after {len(sent)} tokens" if sent else "trying again",
                            self.client.endpoints[self.client._current])
