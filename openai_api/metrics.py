"""The HTTP front's Prometheus metrics and the ASGI middleware that records them.

Families (``runtime.metrics.family``, so the names carry the ``tidekv:`` prefix):

    http_requests_total{route, status}           every answered request (499: the client left first)
    http_request_duration_seconds{route}         headers received -> last response byte (a stream: its end)
    http_request_bytes_total{route}              request body bytes read
    http_response_bytes_total{route}             response body bytes sent
    http_connections_refused_total{reason}       max_connections, header_timeout (openai_api.connections)
    http_open_connections                        gauge, at scrape time

``route`` is one of the app's routes or ``other`` (an unknown path: 404), and ``status`` an
HTTP status code, so both label sets stay bounded. The front's series carry no ``model`` or
worker labels: Prometheus' ``instance`` tells fronts apart. Served at ``GET /metrics`` on the
front's own port (as vLLM does), without an API key, like ``/health``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.metrics import PREFIX, REQUEST_BUCKETS, family, scrape_collector, weak_source

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics")
OTHER_ROUTE = "other"
CLIENT_GONE = 499  # nginx's code for a client that closed its connection before the answer
REFUSAL_REASONS = ("max_connections", "header_timeout")


class FrontMetrics:
    """The front's families in ``registry`` (default ``runtime.metrics.REGISTRY``). Thread-safe."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry
        self.requests = family(registry, Counter, "http_requests", "HTTP requests answered, by route and status",
                               ("route", "status"))
        self.duration = family(registry, Histogram, "http_request_duration_seconds",
                               "HTTP request time from its headers to its last response byte", ("route",),
                               buckets=REQUEST_BUCKETS)
        self.request_bytes = family(registry, Counter, "http_request_bytes", "HTTP request body bytes read",
                                    ("route",))
        self.response_bytes = family(registry, Counter, "http_response_bytes", "HTTP response body bytes sent",
                                     ("route",))
        self.refused = family(registry, Counter, "http_connections_refused",
                              "HTTP connections closed by the front's limits, by reason", ("reason",))
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)
        self.failovers = family(registry, Counter, "http_conductor_failovers",
                                "Generate calls moved to another Conductor replica: retried (before any token) "
                                "or resumed (mid-stream, after the tokens received)", ("kind",))
        for kind in ("retried", "resumed"):
            self.failovers.labels(kind)
        for route in ROUTES:
            self.duration.labels(route)

    def follow_connections(self, owner: Any, count: Callable[[Any], int]) -> None:
        """Report ``count(owner)`` as ``http_open_connections`` at every scrape while ``owner`` lives."""

        def read(obj: Any) -> Iterable[Any]:
            g = GaugeMetricFamily(PREFIX + "http_open_connections", "HTTP connections open at the front")
            g.add_metric([], count(obj))
            return [g]

        scrape_collector(self.registry, "openai_api").add(owner, weak_source(owner, read))

    def failed_over(self, resumed: bool) -> None:
        self.failovers.labels("resumed" if resumed else "retried").inc()

    def refuse(self, reason: str) -> None:
        self.refused.labels(reason).inc()

    def observe(self, route: str, status: int, seconds: float, request_bytes: int, response_bytes: int) -> None:
        self.requests.labels(route, str(status)).inc()
        self.duration.labels(route).observe(seconds)
        if request_bytes:
            self.request_bytes.labels(route).inc(request_bytes)
        if response_bytes:
            self.response_bytes.labels(route).inc(response_bytes)


def route_of(path: str) -> str:
    return path if path in ROUTES else OTHER_ROUTE


class MetricsMiddleware:
    """Pure ASGI (a stream's body passes through untouched): counts each HTTP request once it ends."""

    def __init__(self, app: ASGIApp, metrics: FrontMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        seen = {"status": 0, "in": 0, "out": 0}

        async def counted_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                seen["in"] += len(message.get("body", b""))
            return message

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body":
                seen["out"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counted_receive, counted_send)
        except BaseException:
            seen["status"] = seen["status"] or 500  # uvicorn answers 500 for what escapes the app
            raise
        finally:
            self.metrics.observe(route_of(scope["path"]), seen["status"] or CLIENT_GONE,
                                 time.perf_counter() - start, seen["in"], seen["out"])
