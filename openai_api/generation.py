"""One ``tidekv.v1.Inference/Generate`` call, seen by the HTTP front as a stream of text pieces.

``Generation.start`` sends the request and waits for the first message, so that a refusal
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, ...) becomes an HTTP status before any
response byte is committed. ``pieces`` then yields ``Piece``s: text that is safe to show (see
``textstream``) with the token ids received since the last piece; the last piece carries the
finish reason. A matched stop string cancels the gRPC call at once, which makes the Conductor
free the request's pages on both workers; so does leaving ``pieces`` early (the HTTP client
went away: the task is cancelled and the ``finally`` cancels the call).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

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


class Generation:
    """Not thread-safe: driven by one request's task on the event loop."""

    def __init__(self, stub: pgrpc.InferenceStub, params: GenerationParams, request_id: str,
                 tokenizer: Tokenizer, timeout_s: float, metadata: tuple[tuple[str, str], ...] = ()):
        self.params, self.request_id = params, request_id
        self._stub, self._timeout_s, self._metadata = stub, timeout_s, metadata
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

    async def start(self) -> None:
        """Sends the request; raises ApiError when the Conductor refuses it."""
        self._call = self._stub.Generate(self.params.to_proto(self.request_id), timeout=self._timeout_s,
                                         metadata=self._metadata or None)
        try:
            first = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise self._rpc_error(e) from None
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
            raise self._rpc_error(e) from None
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
