"""A man in the middle for the tests: a gRPC server on 127.0.0.1 (in the test process) that
forwards every unary call's exact bytes and its ``x-tidekv-*`` metadata to a target, records
them, and may edit a request body on the way or answer a call itself. It holds no secret:
it is the attacker of issue 20's finding 3 between a worker and the Conductor."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc

from runtime.grpc_server import channel


@dataclass(frozen=True)
class Seen:
    """One call as the relay received it, and how the target answered (``code`` "OK" or a status)."""

    method: str
    body: bytes
    metadata: tuple[tuple[str, str], ...]
    code: str = ""
    details: str = ""


class Relay(grpc.GenericRpcHandler):
    """``rewrite(method, body) -> body`` edits what is forwarded (None: nothing);
    ``answer(method, body) -> bytes | None`` answers a call itself (None: forward it)."""

    def __init__(self, target: str):
        self.target = target
        self.rewrite: Callable[[str, bytes], bytes] | None = None
        self.answer: Callable[[str, bytes], bytes | None] | None = None
        self._lock = threading.Lock()
        self._seen: list[Seen] = []
        self._channel = channel(target)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self._server.add_generic_rpc_handlers((self,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def seen(self, method: str = "") -> list[Seen]:
        with self._lock:
            return [s for s in self._seen if s.method.endswith(method)]

    def service(self, details: grpc.HandlerCallDetails):
        method = details.method
        return grpc.unary_unary_rpc_method_handler(lambda body, context: self._forward(method, body, context))

    def _forward(self, method: str, body: bytes, context: grpc.ServicerContext) -> bytes:
        metadata = tuple((k, v) for k, v in context.invocation_metadata() if k.startswith("x-tidekv-"))
        own = self.answer(method, body) if self.answer is not None else None
        if own is not None:
            self._record(Seen(method, body, metadata, "ANSWERED_BY_RELAY"))
            return own
        sent = self.rewrite(method, body) if self.rewrite is not None else body
        try:
            reply = self._channel.unary_unary(method)(sent, metadata=metadata, timeout=10)
        except grpc.RpcError as e:
            self._record(Seen(method, body, metadata, e.code().name, e.details() or ""))
            context.abort(e.code(), e.details() or "")
        self._record(Seen(method, body, metadata, "OK"))
        return reply

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self._seen.append(seen)

    def close(self) -> None:
        self._server.stop(0)
        self._channel.close()


def send(address: str, seen: Seen) -> bytes:
    """Sends a recorded call again, exactly as it was received (a replay)."""
    with channel(address) as ch:
        return ch.unary_unary(seen.method)(seen.body, metadata=seen.metadata, timeout=10)
