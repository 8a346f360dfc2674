"""gRPC server plumbing shared by every Tidekv process: bind, health, reflection, drain.

``start_server`` binds ``host:port`` (127.0.0.1 unless told otherwise; port 0 picks a free
one), registers the standard health service (all given services SERVING) and server
reflection. ``serve_until_signal`` blocks until SIGTERM/SIGINT, then marks the process NOT
SERVING and drains: a worker's ``drain`` refuses new requests but keeps serving the RPCs of
requests it already holds until they end; then the server stops accepting RPCs and lets
in-flight ones finish within ``grace_s``.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20


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
        self.server.stop(grace_s).wait()


def start_server(
    add_services: Sequence[Callable[[grpc.Server], None]], service_names: Sequence[str],
    host: str = "127.0.0.1", port: int = 0, max_workers: int = 64, advertise_host: str = "",
) -> RunningServer:
    """Binds ``host:port`` and starts serving (health SERVING). ``advertise_host`` (default:
    ``host``, loopback for a wildcard) is the host in ``RunningServer.address``."""
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options)
    for add in add_services:
        add(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port}")
    server.start()
    if not advertise_host:
        advertise_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    running = RunningServer(server, bound, health_servicer, tuple(service_names), advertise_host)
    running.set_serving(True)
    return running


def serve_until_signal(running: RunningServer, grace_s: float = 30.0,
                       on_stop: Callable[[], None] | None = None,
                       drain: Callable[[float], None] | None = None) -> None:
    """Blocks until SIGTERM or SIGINT, then drains (see module docstring) and returns.

    ``drain(timeout_s)`` must refuse new work and return once the process holds no request
    (or the timeout passed)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("signal received: draining in-flight requests (up to %.0f s)", grace_s)
    running.set_serving(False)
    if drain is not None:
        drain(grace_s)
    running.stop(grace_s)
    if on_stop is not None:
        on_stop()


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])


def wait_for_signal() -> None:
    """Blocks until SIGTERM/SIGINT (used by ``tidekv up`` in the foreground)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print("press Ctrl-C to stop", flush=True)
    stop.wait()
