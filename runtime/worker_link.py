"""A worker's link to the Conductor's registry: register, then heartbeat with load and block events.

Register is signed with the cluster secret and carries the instance id; heartbeats are
signed with the session key that id makes (``runtime.auth``), so only this process can
speak for its worker id. Runs one daemon thread per worker. Block events waiting in the worker (``drain_events``) go
out with the next heartbeat; when the Conductor answers that it does not
know the worker (it restarted, or the worker expired), the link registers again and
republishes every block the worker still holds (``all_blocks``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from kvstore.index import WorkerLoad
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from proto.convert import load_to_proto
from runtime.auth import CONDUCTOR, WorkerCredential

log = logging.getLogger(__name__)
MAX_EVENTS_PER_HEARTBEAT = 20_000  # ~1 MB: within the Conductor's message limit


class WorkerLink:
    def __init__(self, conductor_address: str, info: ipb.WorkerInfo, load: Callable[[], WorkerLoad],
                 credential: WorkerCredential, all_blocks: Callable[[], list[ipb.BlockEvent]] = list,
                 drain_events: Callable[[], list[ipb.BlockEvent]] = list, interval_s: float = 0.5):
        self.info = ipb.WorkerInfo()
        self.info.CopyFrom(info)
        self.info.instance_id = credential.instance_id
        self._load = load
        self._all_blocks = all_blocks
        self._drain_events = drain_events
        self._interval_s = interval_s
        member = credential.member
        self._register_stub = igrpc.RegistryStub(member.channel(conductor_address, audience=CONDUCTOR))
        self._stub = igrpc.RegistryStub(member.channel(conductor_address, credential.session_key, audience=CONDUCTOR))
        self._pending: list[ipb.BlockEvent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._registered = False
        self._thread = threading.Thread(target=self._run, name="worker-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def registered(self) -> bool:
        """True once the Conductor accepted this worker; False again while it must re-register."""
        return self._registered

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._registered:
                    self._register()
                if self._registered:
                    self._heartbeat()
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    log.error("the conductor refused this worker's credential (%s: %s); is "
                              "--cluster-secret-file the cluster's?", e.code().name, e.details())
                else:
                    log.warning("conductor unreachable (%s); retrying", e.code())
                self._registered = False
            self._stop.wait(self._interval_s)

    def _register(self) -> None:
        resp = self._register_stub.Register(ipb.RegisterRequest(info=self.info), timeout=5)
        if not resp.accepted:
            log.error("conductor refused registration: %s", resp.reason)
            return
        self._registered = True
        if resp.heartbeat_interval_s > 0:
            self._interval_s = resp.heartbeat_interval_s
        with self._lock:
            self._pending = self._all_blocks() + self._pending

    def _heartbeat(self) -> None:
        with self._lock:  # a republish of many blocks goes out over several heartbeats
            events = self._pending + self._drain_events()
            events, self._pending = events[:MAX_EVENTS_PER_HEARTBEAT], events[MAX_EVENTS_PER_HEARTBEAT:]
        try:
            request = ipb.HeartbeatRequest(worker_id=self.info.worker_id, load=load_to_proto(self._load()),
                                           events=events)
            resp = self._stub.Heartbeat(request, timeout=5)
        except grpc.RpcError as e:
            with self._lock:
                self._pending = events + self._pending
            if e.code() != grpc.StatusCode.PERMISSION_DENIED:
                raise
            # A Conductor that does not know this instance (it restarted, or expired us).
            log.warning("the conductor does not know this worker instance; registering again")
            self._registered = False
            return
        if not resp.known:  # the events were not applied: they go out again after re-registering
            with self._lock:
                self._pending = events + self._pending
            self._registered = False
