"""The HTTP front as a ``runtime.service.Service``: uvicorn (uvloop, httptools) on a thread of its own.

``build(config)`` makes a ``FrontService``; ``start`` binds the port and serves until
``drain`` (stop accepting, let open requests and streams finish within the grace, then close)
or ``stop``. The same object runs behind ``tidekv serve --role http`` (``serve``, which
drains on SIGTERM/SIGINT) and inside a Ray actor (``deploy.ray_launcher``). uvicorn runs
with the front's connection limits (``openai_api.connections``) and, given ``--tls-cert`` and
``--tls-key``, serves HTTPS; ``/metrics`` is served on the same port, so it is under the same
limits and the same TLS.
"""

from __future__ import annotations

import logging
import resource
import socket
import threading
import time

import uvicorn
from prometheus_client import CollectorRegistry

from openai_api.config import FrontConfig, config_from_args
from openai_api.connections import ConnectionLimits, guarded_protocol
from openai_api.metrics import FrontMetrics
from openai_api.server import build_app

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
SPARE_FILES = 256  # descriptors beyond the connections: the gRPC channel, logs, the model's files


def _allow_connections(num_connections: int) -> None:
    """Raises the soft limit on open files so that ``num_connections`` sockets fit (up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = num_connections + SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warning("open files limited to %d: fewer than --max-connections %d fit", new, num_connections)


class FrontService:
    """Thread-safe lifecycle methods; the app itself runs on the server thread's event loop."""

    role = "http"

    def __init__(self, config: FrontConfig, registry: CollectorRegistry | None = None):
        config.require_conductor()
        self.config = config
        self.metrics = FrontMetrics(registry)
        self.app = build_app(config, self.metrics)  # loads the tokenizer, template and keys now
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._port = 0
        self._draining = False

    @property
    def name(self) -> str:
        return "http front"

    @property
    def address(self) -> str:
        """``host:port`` clients dial ("" before start)."""
        return f"{self.config.advertised_host}:{self._port}" if self._port else ""

    @property
    def url(self) -> str:
        """The base URL of the OpenAI API (``.../v1``), "" before start."""
        scheme = "https" if self.config.tls.serves else "http"
        return f"{scheme}://{self.address}/v1" if self._port else ""

    def open_connections(self) -> int:
        return len(self._server.server_state.connections) if self._server is not None else 0

    def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("the http front already started")
        c = self.config
        _allow_connections(c.max_connections)
        sock = socket.socket(socket.AF_INET6 if ":" in c.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((c.host, c.port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"the http front cannot bind {c.host}:{c.port}: {e}") from e
        self._port = sock.getsockname()[1]
        protocol = guarded_protocol(ConnectionLimits(c.max_connections, c.header_timeout_s), self.metrics)
        tls = c.tls
        server = uvicorn.Server(uvicorn.Config(
            self.app, loop="uvloop", http=protocol, lifespan="on", log_level="warning", access_log=False,
            timeout_keep_alive=c.keep_alive_s, timeout_graceful_shutdown=max(1, round(c.drain_timeout_s)),
            ssl_certfile=tls.cert or None, ssl_keyfile=tls.key or None))
        self._server = server
        self.metrics.follow_connections(self, FrontService.open_connections)
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http-front", daemon=True)
        self._thread.start()
        until = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > until:
                self.stop()
                raise RuntimeError("the http front did not start (see the log above)")
            time.sleep(0.02)

    def ready(self) -> bool:
        """Serving and not draining (whether the Conductor is ready is ``GET /ready``'s answer)."""
        return (self._server is not None and self._server.started and not self._draining
                and self._thread is not None and self._thread.is_alive())

    def drain(self, timeout_s: float) -> None:
        """Stops accepting connections, lets open requests (streams included) finish within
        ``timeout_s``, then closes what is left. Blocks until done."""
        self._draining = True
        if self._server is None or self._thread is None:
            return
        self._server.config.timeout_graceful_shutdown = max(1, round(timeout_s))
        self._server.should_exit = True
        self._thread.join(timeout_s + 10)

    def stop(self) -> None:
        """Closes everything at once (call ``drain`` first for a graceful end). Idempotent."""
        self._draining = True
        if self._server is not None:
            self._server.force_exit = True
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)


def build(config: FrontConfig) -> FrontService:
    return FrontService(config)


def serve(argv: list[str] | None = None) -> None:
    """``tidekv serve --role http``: blocks until SIGTERM/SIGINT, then lets open requests finish."""
    from runtime.service import serve_until_signal

    config = config_from_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def started(service: FrontService) -> None:
        keys = f"API keys checked here ({config.api_keys}) and" if config.api_keys else "API keys checked"
        print(f"tidekv http front serving on {service.url.removesuffix('/v1')} (conductor {config.conductor}, "
              f"model {config.model_name}; {keys} by the Conductor; TLS {'on' if config.tls.serves else 'off'}; "
              f"body <= {config.max_body_bytes} bytes, <= {config.max_connections} connections)", flush=True)

    serve_until_signal(FrontService(config), config.drain_timeout_s, on_started=started)
