"""One ``tidekv.v1.Inference/Generate`` call, seen by the HTTP front as a stream of text pieces.

``Generation.start`` sends the request and waits for the first message, so that a refusal
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, ...) becomes an HTTP status before any
response byte is committed. ``pieces`` then yields ``Piece``s: text that is safe to show (see
``textstream``) with the token ids received since the last piece; the last piece carries the
finish reason. A matched stop string cancels the gRPC call at once, which makes the Conductor
free the request's pages on both workers; so does leaving ``pieces`` early (the HTTP client
went away: the task is cancelled and the ``finally`` cancels the call).

The front knows every Conductor replica (``Conductors``). A call that a replica cannot take
(it is down or draining, or its connection dropped; not a refusal of the request) goes to the
next one; a stream whose Conductor dies mid-way is resumed on another replica after the tokens
already received (``GenerateRequest.resume``, token-exact), so the HTTP client sees one
uninterrupted stream. Each failover is counted (``tidekv:http_conductor_failovers_total``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2_grpc

from conductor.client import FAILOVER_BACKOFF_MAX_S, FAILOVER_BACKOFF_S, MAX_FAILOVERS, is_failover
from engine.tokenizer import Tokenizer
from openai_api.errors import ApiError, from_rpc
from openai_api.protocol import GenerationParams
from openai_api.textstream import Detokenizer, StopMatcher
from proto import inference_pb2 as pb
from proto import inference_pb2_grpc as pgrpc

log = logging.getLogger(__name__)

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class Piece:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" on the last piece


class Conductors:
    """The Conductor replicas the front calls: one channel each, calls going to the current one
    until it fails (``failed_over``). Used on the event loop only."""

    def __init__(self, addresses: Sequence[str], channels: Sequence[grpc.aio.Channel], metrics=None):
        self.addresses, self._channels, self.metrics = list(addresses), list(channels), metrics
        self._stubs = [pgrpc.InferenceStub(ch) for ch in self._channels]
        self._current = 0

    @property
    def stub(self) -> pgrpc.InferenceStub:
        return self._stubs[self._current]

    @property
    def address(self) -> str:
        return self.addresses[self._current]

    def failed_over(self, dead: pgrpc.InferenceStub, resumed: bool) -> None:
        if dead is self._stubs[self._current] and len(self._stubs) > 1:
            self._current = (self._current + 1) % len(self._stubs)
        if self.metrics is not None:
            self.metrics.failed_over(resumed)

    def health_stubs(self) -> list[tuple[str, health_pb2_grpc.HealthStub]]:
        """The replicas' health stubs, the current one first."""
        order = [*range(self._current, len(self._channels)), *range(self._current)]
        return [(self.addresses[i], health_pb2_grpc.HealthStub(self._channels[i])) for i in order]

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close(grace=None)


class Generation:
    """Not thread-safe: driven by one request's task on the event loop."""

    def __init__(self, conductors: Conductors, params: GenerationParams, request_id: str,
                 tokenizer: Tokenizer, timeout_s: float, metadata: tuple[tuple[str, str], ...] = ()):
        self.params, self.request_id = params, request_id
        self._conductors, self._timeout_s, self._metadata = conductors, timeout_s, metadata
        self._until = time.monotonic() + timeout_s
        self._failovers = 0
        self._stub: pgrpc.InferenceStub | None = None  # of the replica the current call went to
        self._detok = Detokenizer(tokenizer)
        self._stops = StopMatcher(params.stop)
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._first: pb.GenerateResponse | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.finished = False  # the last piece was made (a finish reason reached)
        self._closed = False

    @property
    def token_ids(self) -> list[int]:
        """Every token id received so far (those that completed a stop string included)."""
        return self._detok.ids

    def usage(self) -> dict:
        completion = len(self._detok.ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def _rpc_error(self, e: grpc.aio.AioRpcError) -> ApiError:
        return from_rpc(e.code(), e.details() or "", e.trailing_metadata(), dict(self.params.field_names))

    async def _open(self) -> pb.GenerateResponse | object:
        """Calls the current replica (resuming after the tokens received, if any) and reads the
        first message, failing over while ``is_failover`` says another replica should try."""
        while True:
            req = self.params.to_proto(self.request_id)
            req.failover = self._failovers > 0
            if self._detok.ids:
                req.resume.ids[:] = self._detok.ids
            stub = self._stub = self._conductors.stub
            self._call = stub.Generate(req, timeout=max(0.001, self._until - time.monotonic()),
                                       metadata=self._metadata or None)
            try:
                return await self._call.read()
            except grpc.aio.AioRpcError as e:
                if self._closed or not is_failover(e) or self._failovers >= MAX_FAILOVERS:
                    raise self._rpc_error(e) from None
                self._failovers += 1
                self._conductors.failed_over(stub, resumed=bool(self._detok.ids))
                log.warning("request %s: Conductor failed the call (%s); %s on %s", self.request_id, e.code().name,
                            f"resuming after {len(self._detok.ids)} tokens" if self._detok.ids else "trying again",
                            self._conductors.address)
                await asyncio.sleep(min(FAILOVER_BACKOFF_MAX_S, FAILOVER_BACKOFF_S * 2 ** (self._failovers - 1),
                                        max(0.0, self._until - time.monotonic())))

    async def start(self) -> None:
        """Sends the request; raises ApiError when the Conductor refuses it."""
        first = await self._open()
        if first is grpc.aio.EOF:
            raise ApiError(502, "the Conductor ended the stream without an answer", "server_error")
        if first.finish_reason and first.finish_reason not in FINISH:
            # Failed before any token (e.g. prefill failed on every worker tried): nothing was
            # generated, so it is the cluster that is unavailable.
            raise ApiError(503, first.error or pb.FinishReason.Name(first.finish_reason),
                           "service_unavailable_error", code="generation_failed")
        self._first = first

    def cancel(self) -> None:
        """Cancels the gRPC call; idempotent, a no-op once it ended. (A task cancelled while it
        awaits the call, as when the client goes away, has already cancelled it in grpc.aio.)"""
        if self._call is None or self._closed:
            return
        self._closed = True
        self._call.cancel()
        if not self.finished:
            log.info("request %s: cancelled before its finish (the client went away)", self.request_id)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text pieces until the finish; raises ApiError for a call that fails mid-stream."""
        assert self._call is not None and self._first is not None, "start() first"
        msg, pending = self._first, []
        try:
            while True:
                if msg.HasField("usage"):
                    self.prompt_tokens, self.cached_tokens = msg.usage.prompt_tokens, msg.usage.cached_tokens
                if msg.token_ids:
                    pending.extend(msg.token_ids)
                    text, stopped = self._stops.feed(self._detok.push(msg.token_ids))
                    if stopped:
                        self.finished = True
                        self.cancel()  # frees the pages now, not after max_tokens
                        yield Piece(text, tuple(pending), "stop")
                        return
                    if text:
                        yield Piece(text, tuple(pending))
                        pending = []
                if msg.finish_reason:
                    yield self._last(msg, pending)
                    return
                msg = await self._read()
        finally:
            self.cancel()

    async def _read(self) -> pb.GenerateResponse:
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as e:
            if self._closed or not is_failover(e) or self._failovers >= MAX_FAILOVERS:
                raise self._rpc_error(e) from None
            self._failovers += 1
            self._conductors.failed_over(self._stub, resumed=True)
            log.warning("request %s: its Conductor failed mid-stream (%s); resuming after %d tokens on %s",
                        self.request_id, e.code().name, len(self._detok.ids), self._conductors.address)
            msg = await self._open()
        if msg is grpc.aio.EOF:
            raise ApiError(502, "the Conductor ended the stream without a finish", "server_error")
        return msg

    def _last(self, msg: pb.GenerateResponse, pending: list[int]) -> Piece:
        reason = FINISH.get(msg.finish_reason)
        if reason is None:
            raise ApiError(500, msg.error or pb.FinishReason.Name(msg.finish_reason), "server_error",
                           code="generation_failed")
        text, stopped = self._stops.feed(self._detok.flush())
        text += "" if stopped else self._stops.flush()
        self.finished = True
        log.debug("request %s finished: %s, %d tokens", self.request_id, reason, len(self._detok.ids))
        return Piece(text, tuple(pending), "stop" if stopped else reason)
