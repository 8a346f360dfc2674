"""Connection limits of the HTTP front: a cap on open connections and a deadline for headers.

uvicorn has neither: a client that opens a connection and sends nothing, or its headers a
byte at a time, holds the connection forever (500 such connections stayed open). This is
uvicorn's httptools protocol (uvicorn is pinned in pyproject.toml) with two additions:

- **Connection cap.** A connection beyond ``max_connections`` is answered at once with a 503
  in OpenAI's error shape and closed; it never reaches the app.
- **Header deadline.** From the moment the server waits for a request (the connection is made,
  or the previous response has ended on a keep-alive connection), its headers must be complete
  within ``header_timeout_s``. Otherwise the connection is closed: with a 408 when part of a
  request had come, silently when nothing had.

The body's deadline and size are the app's (``openai_api.body``): the app reads the body.
With TLS the protocol starts after the handshake, which asyncio bounds to 60 s on its own.
"""

from __future__ import annotations

import json
from asyncio import TimerHandle
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from openai_api.metrics import FrontMetrics


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float


def _raw_error(status: int, reason: str, message: str, kind: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


class GuardedProtocol(HttpToolsProtocol):
    """One connection; runs on the event loop only. ``guarded_protocol`` makes the subclass
    that carries the limits, the metrics and the prepared refusals."""

    limits: ConnectionLimits
    metrics: FrontMetrics
    busy: bytes  # the 503 beyond max_connections
    slow: bytes  # the 408 past the header deadline
    _header_timer: TimerHandle | None = None
    _partial = False  # bytes of the request being waited for have come

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.metrics.refuse("max_connections")
            transport.write(self.busy)
            transport.close()
            return
        self._wait_for_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        self._partial = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._stop_waiting()
        self._partial = False
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline and self._header_timer is None:
            self._wait_for_headers()

    def _wait_for_headers(self) -> None:
        self._stop_waiting()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_too_late)

    def _stop_waiting(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        self.metrics.refuse("header_timeout")
        if self._partial:
            self.transport.write(self.slow)
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits, metrics: FrontMetrics) -> type[GuardedProtocol]:
    """uvicorn's ``http`` protocol class with ``limits`` applied (pass it as ``uvicorn.Config(http=...)``)."""
    busy = _raw_error(503, "Service Unavailable", f"the server holds its limit of {limits.max_connections} "
                      "connections (max_connections); retry later", "service_unavailable_error", "too_many_connections")
    slow = _raw_error(408, "Request Timeout", f"the request headers did not arrive within {limits.header_timeout_s:g}"
                      " s (header_timeout_s)", "invalid_request_error", "request_timeout")
    return type("LimitedProtocol", (GuardedProtocol,), {"limits": limits, "metrics": metrics, "busy": busy,
                                                        "slow": slow})
