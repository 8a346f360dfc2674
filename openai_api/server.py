"""The HTTP front's Starlette app (``build_app``): routes, the shared gRPC channel, error rendering.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE), ``GET
/v1/models``, ``GET /health`` (this process is up), ``GET /ready`` (the Conductor's gRPC
health says SERVING), ``GET /metrics`` (the front's own Prometheus metrics). Every request is
one gRPC ``Generate`` call on one shared ``grpc.aio`` channel, opened in the app's lifespan
(it belongs to the event loop). A POST is taken in this order, each step refusing before the
next costs anything: the API key (``keys``, from the headers), the body's size and arrival
time (``body.read_body``), its JSON nesting and fields (``body.parse_json``, ``protocol``;
a body over ``OFFLOAD_BYTES`` is parsed on a worker thread so the event loop keeps serving).
A client that goes away cancels the call: for a stream through ``_Stream``, for a whole
response through ``_unless_disconnected``, which watches the ASGI ``http.disconnect`` while
the answer is made. Errors are rendered once, in OpenAI's shape, by the exception handlers at
the bottom. The process around the app (uvicorn, limits, TLS) is ``openai_api.service``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import engine
from openai_api.body import BodyLimits, Disconnected, parse_json, read_body
from openai_api.chat_template import load_chat_template
from openai_api.config import FrontConfig
from openai_api.errors import ApiError
from openai_api.generation import Conductors, Generation
from openai_api.keys import FrontKeys, Metadata
from openai_api.metrics import CLIENT_GONE, FrontMetrics, MetricsMiddleware
from openai_api.protocol import GenerationParams, RequestContext, parse_chat, parse_completion
from openai_api.render import DONE, Shape, error_event
from runtime.grpc_server import CHANNEL_OPTIONS
from runtime.metrics import REGISTRY

log = logging.getLogger(__name__)

HEALTH_SERVICE = "tidekv.v1.Inference"
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,48}")  # what the Conductor accepts as a request_id
OFFLOAD_BYTES = 64 << 10  # bodies above this are parsed (JSON, chat template, tokenizer) on a thread
T = TypeVar("T")


class Front:
    """What the handlers share: the config, the model's tokenizer and chat template, the keys,
    the limits, the metrics and the channel."""

    def __init__(self, config: FrontConfig, metrics: FrontMetrics):
        self.config = config
        self.metrics = metrics
        cfg = engine.load_config(config.model)
        self.tokenizer = engine.load_tokenizer(config.model)
        self.template = load_chat_template(config.model, config.chat_template)
        self.max_model_len = cfg.max_seq_len
        self.ctx = RequestContext(served_model_name=config.model_name, eos_token_id=self.tokenizer.eos_token_id,
                                  max_model_len=cfg.max_seq_len, default_max_tokens=config.default_max_tokens,
                                  default_chat_max_tokens=config.default_chat_max_tokens)
        self.keys = FrontKeys(config.api_keys)
        self.limits = BodyLimits(config.max_body_bytes, config.max_json_depth, config.body_timeout_s)
        self.conductors: Conductors | None = None

    async def open(self) -> None:
        options = list(CHANNEL_OPTIONS)
        creds = None
        if self.config.tls_ca:
            creds = grpc.ssl_channel_credentials(root_certificates=Path(self.config.tls_ca).read_bytes())
        channels = [grpc.aio.secure_channel(a, creds, options=options) if creds is not None
                    else grpc.aio.insecure_channel(a, options=options) for a in self.config.conductors]
        self.conductors = Conductors(self.config.conductors, channels, self.metrics)

    async def close(self) -> None:
        if self.conductors is not None:
            await self.conductors.close()

    async def params(self, request: Request, parse: Callable[[object], GenerationParams]) -> GenerationParams:
        """The request's body, read within the limits and parsed by ``parse`` (the endpoint's
        fields); ApiError for a refusal, Disconnected when the client left."""
        body = await read_body(request, self.limits)

        def parsed() -> GenerationParams:
            return parse(parse_json(body, self.limits))

        return await asyncio.to_thread(parsed) if len(body) > OFFLOAD_BYTES else parsed()


def _request_id(request: Request) -> str:
    """The client's ``X-Request-Id`` when it is a usable id (it then names the request in every
    Tidekv log, as gRPC's ``request_id`` does), else a fresh one."""
    given = request.headers.get("x-request-id", "")
    return given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Runs ``work`` (after the body was read) while watching for the client to leave;
    (False, None) when it left first, ``work`` then being cancelled."""

    async def left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(left())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (server shutdown)
        watch.cancel()
        finished = task.done()
        if not finished:
            task.cancel()
    if finished:
        return True, task.result()  # raises the work's ApiError, if any
    with contextlib.suppress(asyncio.CancelledError, ApiError):
        await task
    return False, None


class _Stream(StreamingResponse):
    """An SSE response that cancels its gRPC call however the response ends (client gone included)."""

    def __init__(self, generation: Generation, events: AsyncIterator[bytes], headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancel()


async def _events(gen: Generation, shape: Shape) -> AsyncIterator[bytes]:
    if shape.chat:
        yield shape.chunk(None, (), role=True)
    try:
        async for piece in gen.pieces():
            if piece.text or piece.finish_reason:
                yield shape.chunk(piece.text, piece.token_ids, piece.finish_reason)
        if shape.include_usage:
            yield shape.usage_chunk(gen.usage())
    except ApiError as e:  # after the 200 went out: the failure is told as an event
        log.warning("request %s failed mid-stream: %s", gen.request_id, e.message)
        yield error_event(e.body())
    yield DONE


async def _collect(gen: Generation, shape: Shape) -> dict:
    await gen.start()
    texts, reason = [], "length"
    async for piece in gen.pieces():
        texts.append(piece.text)
        reason = piece.finish_reason or reason
    return shape.response("".join(texts), list(gen.token_ids), reason, gen.usage())


async def _generate(request: Request, params: GenerationParams, chat: bool, metadata: Metadata) -> Response:
    front: Front = request.app.state.front
    request_id = _request_id(request)
    shape = Shape(chat, ("chatcmpl-" if chat else "cmpl-") + request_id, front.config.model_name,
                  params.include_usage)
    gen = Generation(front.conductors, params, request_id, front.tokenizer, front.config.request_timeout_s,
                     metadata)
    headers = {"X-Request-Id": request_id}
    log.debug("request %s (user %r): stream=%s max_tokens=%d", request_id, params.user, params.stream,
              params.max_tokens)
    if params.stream:
        started, _ = await _unless_disconnected(request, gen.start())
        if not started:
            gen.cancel()
            return Response(status_code=CLIENT_GONE)
        return _Stream(gen, _events(gen, shape), {**headers, "Cache-Control": "no-cache"})
    done, body = await _unless_disconnected(request, _collect(gen, shape))
    if not done:
        gen.cancel()
        return Response(status_code=CLIENT_GONE)  # nobody reads it: the client is gone
    return JSONResponse(body, headers=headers)


# ---- routes -----------------------------------------------------------------------------------
async def completions(request: Request) -> Response:
    front: Front = request.app.state.front
    metadata = front.keys.credentials(request)  # before a byte of the body is read
    params = await front.params(request, lambda body: parse_completion(body, front.ctx))
    return await _generate(request, params, chat=False, metadata=metadata)


async def chat_completions(request: Request) -> Response:
    front: Front = request.app.state.front
    metadata = front.keys.credentials(request)
    params = await front.params(request, lambda body: parse_chat(body, front.ctx, front.template,
                                                                 front.tokenizer.encode))
    return await _generate(request, params, chat=True, metadata=metadata)


async def models(request: Request) -> Response:
    front: Front = request.app.state.front
    front.keys.credentials(request)
    card = {"id": front.config.model_name, "object": "model", "created": 0, "owned_by": "tidekv",
            "max_model_len": front.max_model_len, "context_length": front.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})


async def metrics_route(request: Request) -> Response:
    front: Front = request.app.state.front
    registry = REGISTRY if front.metrics.registry is None else front.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Ready while some Conductor replica is SERVING (the front fails over to it)."""
    front: Front = request.app.state.front
    statuses = []
    for address, health in front.conductors.health_stubs():
        try:
            resp = await health.Check(health_pb2.HealthCheckRequest(service=HEALTH_SERVICE),
                                      timeout=front.config.health_timeout_s)
        except grpc.aio.AioRpcError as e:
            statuses.append(f"{address} unreachable: {e.code().name}")
            continue
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            return JSONResponse({"status": "ready", "conductor": status})
        statuses.append(f"{address} is {status}")
    code = "conductor_unavailable" if all("unreachable" in s_ for s_ in statuses) else "conductor_not_serving"
    raise ApiError(503, f"no Conductor serving ({'; '.join(statuses)})", "service_unavailable_error", code=code)


# ---- errors: rendered once, in OpenAI's shape -------------------------------------------------
async def _api_error(request: Request, exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _client_gone(request: Request, exc: Disconnected) -> Response:
    return Response(status_code=CLIENT_GONE)  # nobody reads it


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return await _api_error(request, ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                              kind))


async def _internal_error(request: Request, exc: Exception) -> Response:
    """The process's outermost boundary: log the traceback, answer 500, keep serving."""
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return await _api_error(request, ApiError(500, f"internal error: {type(exc).__name__}", "server_error"))


def build_app(config: FrontConfig, metrics: FrontMetrics | None = None) -> Starlette:
    """The ASGI app; loads the tokenizer, chat template and keys now, opens the channel at startup."""
    metrics = metrics or FrontMetrics()
    front = Front(config, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await front.open()
        try:
            yield
        finally:
            await front.close()

    app = Starlette(
        routes=[Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
                Route("/health", health, methods=["GET"]),
                Route("/ready", ready, methods=["GET"]),
                Route("/metrics", metrics_route, methods=["GET"])],
        exception_handlers={ApiError: _api_error, Disconnected: _client_gone, HTTPException: _http_error,
                            Exception: _internal_error},
        middleware=[Middleware(MetricsMiddleware, metrics=metrics)],
        lifespan=lifespan,
    )
    app.state.front = front
    return app
