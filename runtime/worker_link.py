"""A worker's link to the Conductor's registry: register, then heartbeat with load and block events.

Register is signed with the cluster secret and carries the instance id; heartbeats are
signed with the session key that id makes (``runtime.auth``), so only this process can
speak for its worker id. Runs one daemon thread per worker. Block events waiting in the
worker (``drain_events``) go out with the next heartbeat, numbered (``seq``, from 1 per
instance) so that a replayed or repeated heartbeat changes nothing.

The link talks to one Conductor at a time out of the addresses it is given (``host:port``,
comma-separated: the replicas of one cluster, which share its state). A worker registers
once and heartbeats once, with whichever replica answers: when that one is unreachable the
link moves to the next address and goes on heartbeating there (the replicas know the worker
from the cluster's log). When a Conductor answers that it does not know the worker (its
state lost it, or the worker expired), the link registers again and republishes every block
the worker still holds (``all_blocks``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from clusterstate.workers import WorkerLoad
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
        self._credential = credential
        self._addresses = [a.strip() for a in conductor_address.split(",") if a.strip()]
        if not self._addresses:
            raise ValueError("--conductor needs at least one host:port")
        self._current = -1
        self._channels: list[grpc.Channel] = []
        self._misses = 0  # calls failed in a row, across addresses
        self._connect_next()
        self._seq = 0
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

    @property
    def conductor(self) -> str:
        """The Conductor address the link talks to now."""
        return self._addresses[self._current]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for ch in self._channels:
            ch.close()

    def deregister(self, reason: str, timeout_s: float = 2.0) -> bool:
        """Stops heartbeating and takes this instance out of the registry now (a rank of its
        group died); tries each Conductor address once within ``timeout_s``. True if one
        answered. Safe to call from any thread, more than once."""
        self._stop.set()
        return deregister(self._addresses, self._credential, reason, timeout_s)

    def _connect_next(self) -> None:
        """Talk to the next Conductor address (the first one at start)."""
        for ch in self._channels:
            ch.close()
        self._current = (self._current + 1) % len(self._addresses)
        address, member = self._addresses[self._current], self._credential.member
        self._channels = [member.channel(address, audience=CONDUCTOR),
                          member.channel(address, self._credential.session_key, audience=CONDUCTOR)]
        self._register_stub = igrpc.RegistryStub(self._channels[0])
        self._stub = igrpc.RegistryStub(self._channels[1])

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._registered:
                    self._register()
                if self._registered:
                    self._heartbeat()
                self._misses = 0
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    log.error("the conductor refused this worker's credential (%s: %s); is "
                              "--cluster-secret-file the cluster's?", e.code().name, e.details())
                    self._registered = False
                else:  # the next replica, if there is one, knows this worker from the cluster's log
                    log.warning("conductor %s unreachable (%s); trying %s", self.conductor, e.code().name,
                                self._addresses[(self._current + 1) % len(self._addresses)])
                    self._connect_next()
                    self._misses += 1
                    if self._misses < len(self._addresses):  # another replica may answer at once
                        continue
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
        self._seq += 1
        try:
            request = ipb.HeartbeatRequest(worker_id=self.info.worker_id, load=load_to_proto(self._load()),
                                           events=events, seq=self._seq)
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


def deregister(addresses: list[str], credential: WorkerCredential, reason: str, timeout_s: float = 2.0) -> bool:
    """``Registry/Deregister`` of ``credential``'s instance at the first of ``addresses`` that
    answers (every rank of a group holds the instance's credential, so any of them can)."""
    per_call_s = max(0.2, timeout_s / max(1, len(addresses)))
    for address in addresses:
        ch = credential.member.channel(address, credential.session_key, audience=CONDUCTOR)
        try:
            igrpc.RegistryStub(ch).Deregister(ipb.DeregisterRequest(worker_id=credential.worker_id, reason=reason),
                                              timeout=per_call_s)
            log.warning("deregistered %s at %s: %s", credential.worker_id, address, reason)
            return True
        except grpc.RpcError as e:
            log.warning("deregistering %s at %s failed: %s", credential.worker_id, address, e.code().name)
        finally:
            ch.close()
    return False
