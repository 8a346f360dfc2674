"""The ``Service`` protocol every role implements, and the one wrapper that runs a service as a process.

Each role (conductor, prefill, decode) is an object built from its frozen config
(``conductor.server.build``, ``prefill_worker.server.build``, ``decode_worker.server.build``).
A service installs no signal handlers, reads no environment variable and prints nothing, so it
can be embedded: in a test process, in a Ray actor, or behind ``tidekv serve``. Its life:

    build(config) --start()--> serving (ready() once registered) --drain(t)--> stopped --stop()--> closed

``serve_until_signal`` is the process wrapper: start, block until SIGTERM/SIGINT, drain, stop.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import uuid
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from clusterstate.workers import WorkerLoad
from engine.model import HybridModel
from engine.warmup import warm_up
from proto import internal_pb2 as ipb
from runtime.auth import WorkerCredential
from runtime.grpc_server import RunningServer, follow_readiness
from runtime.metrics import MetricsServer
from runtime.ranks import instance_model
from runtime.worker_config import WorkerConfig
from runtime.worker_link import WorkerLink

log = logging.getLogger(__name__)
SIGNAL_POLL_S = 0.2  # how soon the main thread runs a signal handler another thread took (wait_for_signal)


@runtime_checkable
class Service(Protocol):
    """One role of a cluster, embeddable. Methods are thread-safe unless noted."""

    role: str  # "conductor", "prefill" or "decode"

    def start(self) -> None:
        """Loads the model, binds and starts serving, and (a worker) starts registering with the
        Conductor. Returns once the gRPC server accepts calls; registration goes on in the
        background (see ``ready``). Call once; ``ValueError`` for a config the role refuses."""

    @property
    def address(self) -> str:
        """The advertised ``host:port`` of the gRPC server (what other processes dial); ""
        before ``start``."""

    def ready(self) -> bool:
        """True while the service can do its job: started, serving and not draining; a worker
        also registered with the Conductor (a decode worker with its KV receiver listening)."""

    def drain(self, timeout_s: float) -> None:
        """Reports NOT_SERVING, refuses new work, lets the requests it holds finish (up to
        ``timeout_s``), then stops the gRPC server, giving in-flight calls the same grace.
        Blocks until done. The worker keeps heartbeating until ``stop``."""

    def stop(self) -> None:
        """Releases everything (server, threads, transfer listeners, files it made). Calls still
        in flight are cancelled; call ``drain`` first for a graceful end. Idempotent."""


class ServiceBase:
    """The start and stop mechanics the three roles share. A role's ``_start`` builds its
    parts and registers each one's cleanup on ``self._closing``; ``stop`` closes them in
    reverse; a failed ``start`` stops at once, so it leaves nothing behind. ``address`` is the
    gRPC server's advertised host:port once it serves ("" before)."""

    role = ""

    def __init__(self) -> None:
        self._closing = contextlib.ExitStack()
        self.metrics = MetricsServer("")  # /metrics once started (address "" when off)
        self._running: RunningServer | None = None
        self._draining = False

    @property
    def name(self) -> str:
        return self.role

    @property
    def address(self) -> str:
        return "" if self._running is None else self._running.address

    def start(self) -> None:
        if self._running is not None:
            raise RuntimeError(f"{self.name} already started")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._draining = True
        self._closing.close()


class WorkerServiceBase(ServiceBase):
    """What both worker roles add to ``ServiceBase``: their id (the config's, or the role and a
    random suffix), the credential of this instance, the transfer address, and the last step
    of ``_start``: warm up, then register and keep readiness (``_register``)."""

    def __init__(self, config: WorkerConfig):
        config.require_conductor()
        super().__init__()
        self.config = config
        self.worker_id = config.worker_id or f"{self.role}-{uuid.uuid4().hex[:6]}"
        self.credential = WorkerCredential.new(config.cluster_secret_file, self.worker_id, config.tls)
        self._link: WorkerLink | None = None
        self._transfer_address = ""

    @property
    def name(self) -> str:
        return f"{self.role} worker {self.worker_id}"

    @property
    def transfer_address(self) -> str:
        """The KV transfer endpoint's advertised address ("" before start)."""
        return self._transfer_address

    def _load_model(self) -> HybridModel:
        """This instance's model: the whole model, or for a parallel shape the face of its
        group of ranks (``runtime.ranks``; the ranks stop with the service). A lost rank takes
        the instance out of the registry and ends the process (``runtime.ranks.fail_fast``)."""
        model, close = instance_model(self.config, self.role, self.credential, self._deregister)
        self._closing.callback(close)
        return model

    def _deregister(self, reason: str) -> None:
        if self._link is not None:
            self._link.deregister(reason)

    def _shape_info(self, info: ipb.WorkerInfo) -> ipb.WorkerInfo:
        """``info`` with the instance's parallel shape."""
        shape = self.config.parallel_shape
        info.tp_size, info.ep_size, info.cpp_stages = shape.tp, shape.ep, shape.stages
        if shape.stages > 1:
            info.cpp_chunk_tokens = self.config.cpp_chunk_tokens
        return info

    def _register(self, model: HybridModel, info: ipb.WorkerInfo, load: Callable[[], WorkerLoad],
                  **link_options: Any) -> None:
        """Warms up (unless the config says not to), then registers ``info`` with the Conductor
        and heartbeats ``load`` (``runtime.worker_link``); readiness follows ``ready``."""
        if self.config.warmup:
            log.info("warmed up in %.2f s", warm_up(model, self.config.block_size))
        self._link = WorkerLink(self.config.conductor, self._shape_info(info), load, self.credential, **link_options)
        self._link.start()
        self._closing.callback(self._link.stop)
        assert self._running is not None
        self._closing.callback(follow_readiness(self._running, self.ready))


def wait_for_signal(announce: str = "") -> None:
    """Blocks the calling (main) thread until SIGTERM or SIGINT; installs the two handlers.

    The wait wakes every ``SIGNAL_POLL_S``: Python runs a handler only on the main thread, and
    only when it runs bytecode. The kernel may deliver the signal to any thread (gRPC's, the
    loops'); that interrupts none of the main thread's waits, so an untimed wait would sleep
    through it for good (a SIGTERM left a Conductor running until it was killed)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if announce:
        print(announce, flush=True)
    while not stop.wait(SIGNAL_POLL_S):
        pass


def serve_until_signal(service: Service, drain_timeout_s: float,
                       on_started: Callable[[Service], None] | None = None) -> None:
    """Runs ``service`` as this process's job: start, ``on_started`` (the "serving on" line),
    block until SIGTERM/SIGINT, then drain (NOT_SERVING first, held requests finish, up to
    ``drain_timeout_s``) and stop. The service is stopped whatever happens."""
    try:
        service.start()
        if on_started is not None:
            on_started(service)
        wait_for_signal()
        log.info("signal received: draining in-flight requests (up to %.0f s)", drain_timeout_s)
        service.drain(drain_timeout_s)
    finally:
        service.stop()
