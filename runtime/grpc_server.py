"""gRPC server plumbing shared by every Tidekv process: bind, health, reflection, drain.

``start_server`` binds ``host:port`` (127.0.0.1 unless told otherwise; port 0 picks a free
one), registers the standard health service and server reflection. Health has two meanings:
the overall name ``""`` and each service's name say *ready* (``follow_readiness`` keeps them
equal to the role's ``ready()``: a worker once registered, the Conductor once it has a live
worker of each role; NOT_SERVING while draining), and ``LIVENESS`` says the process is up
(what a liveness or startup probe asks; it never depends on other processes).
``RunningServer.stop(grace_s)`` marks it NOT SERVING, stops accepting RPCs and lets
in-flight ones finish within ``grace_s``. Nothing here installs signal handlers: a role's
``Service`` (``runtime.service``) decides when to drain and stop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from runtime.tls import TlsFiles

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
# A channel whose server went away tries again after 0.25 s, then at most every second
# (gRPC's default backs off to two minutes): a restarted Conductor or worker is reached
# within a heartbeat or two, long before its lease would run out.
RECONNECT_BACKOFF_MS = (250, 1000)
CHANNEL_OPTIONS = (("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                   ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]))
LIVENESS = "tidekv.liveness"  # health name: SERVING from start to stop, whatever the readiness


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    service_names: tuple[str, ...]
    advertise_host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        """host:port that other processes dial (the advertised host, not the bound one)."""
        return f"{self.advertise_host}:{self.port}"

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            self.health.set(name, status)

    def stop(self, grace_s: float) -> None:
        self.set_serving(False)
        self.health.set(LIVENESS, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.stop(grace_s).wait()


def start_server(
    add_services: Sequence[Callable[[grpc.Server], None]], service_names: Sequence[str],
    host: str = "127.0.0.1", port: int = 0, max_workers: int = 64, advertise_host: str = "",
    interceptors: Sequence[grpc.ServerInterceptor] = (), tls: TlsFiles | None = None,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
) -> RunningServer:
    """Binds ``host:port`` and starts serving (health SERVING). ``advertise_host`` (default:
    ``host``, loopback for a wildcard) is the host in ``RunningServer.address``.
    ``interceptors`` see every call first (``runtime.auth.AuthInterceptor``); ``tls`` with a
    certificate serves TLS; a message over ``max_receive_bytes`` is refused by gRPC itself
    (RESOURCE_EXHAUSTED) before it is read into memory."""
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", max_receive_bytes),
               ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options,
                         interceptors=list(interceptors))
    for add in add_services:
        add(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    if tls is not None and tls.serves:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port}")
    server.start()
    if not advertise_host:
        advertise_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    running = RunningServer(server, bound, health_servicer, tuple(service_names), advertise_host)
    running.set_serving(False)  # not ready until the role says so (follow_readiness)
    health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    return running


def follow_readiness(running: RunningServer, ready: Callable[[], bool], interval_s: float = 0.5) -> Callable[[], None]:
    """Keeps ``running``'s readiness health equal to ``ready()`` (checked now and every
    ``interval_s``) in a daemon thread; returns the function that stops it."""
    stop = threading.Event()

    def follow() -> None:
        while True:
            try:
                running.set_serving(ready())
            except Exception:  # noqa: BLE001 - a failing check means not ready, and is logged
                log.exception("readiness check failed")
                running.set_serving(False)
            if stop.wait(interval_s):
                return

    running.set_serving(ready())
    thread = threading.Thread(target=follow, name="readiness", daemon=True)
    thread.start()
    return lambda: (stop.set(), thread.join(timeout=5))


def channel(address: str, tls: TlsFiles | None = None) -> grpc.Channel:
    """A channel to ``address``: TLS verified against ``tls.ca`` when one is given."""
    options = list(CHANNEL_OPTIONS)
    creds = tls.channel_credentials() if tls is not None else None
    if creds is not None:
        return grpc.secure_channel(address, creds, options=options)
    return grpc.insecure_channel(address, options=options)

