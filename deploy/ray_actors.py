"""The processes of a Tidekv cluster on Ray: ``RoleActor`` (one role's service) and
``RankActor`` (a rank other than 0 of a parallel worker instance), with how each finds the
Conductors (``conductor_addresses``) and what it reports (``ActorReport``).

Each actor is a ``RoleActor``: it builds its role's service (``build(config)``, see
``runtime.service``) and starts it in ``__init__``, so a restart by Ray (``max_restarts``)
builds a fresh one, which registers with the Conductor again under the same worker id. Both
kinds serve at normal CPU priority where the node allows it (``serve_at_normal_priority``: Ray
starts its workers at niceness 15). Every
actor binds and advertises its node's address (a role config that names another bind host,
such as 0.0.0.0, keeps it). A worker or front whose config names no Conductor asks the
Conductor actors for their addresses whenever it (re)starts, and is given them all
(comma-separated: it fails over between them). Replica R takes the config's port + R (and
metrics port + R) when they are fixed, so replicas that share a node do not collide.

Every actor but the HTTP front (which signs nothing: it calls the Conductor's public endpoint
with its clients' API keys) gets the cluster secret (``runtime.auth``) as an argument: the one
in the Conductor config's ``cluster_secret_file`` when the driver has it, else a new one; the
Conductor actor keeps it for later scale-ups. A ``RoleActor`` hands it to its service as an
in-memory file (``memfd``, read through ``/proc/<pid>/fd``) only while the service is built
and started, which is when the service reads it: no copy is ever on disk, so none outlives
the actor however it ends (``ray.kill``, SIGKILL, a lost rank's exit). A ``RankActor`` hands
it to its rank in memory. Ray's own channels carry it, so whoever may drive the Ray cluster holds
it, as they can already run code in every actor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray

from deploy.cluster_state import WorkerState, workers_from_response
from deploy.ray_config import CONDUCTOR, CONDUCTOR_NAMES, HTTP, POOLS, RayClusterConfig
from proto import internal_pb2 as ipb
from runtime.auth import Member, worker_principal
from runtime.ports import free_port
from runtime.settings import setup_torch

BUILDERS = {"conductor": "conductor.server", "prefill": "prefill_worker.server", "decode": "decode_worker.server",
            "http": "openai_api.service"}
WILDCARDS = ("0.0.0.0", "::", "")
log = logging.getLogger(__name__)


def conductor_addresses(namespace: str) -> str:
    """Every running Conductor actor's address, comma-separated, replica 0 first."""
    names = sorted((a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["namespace"] == namespace and CONDUCTOR_NAMES.fullmatch(a["name"])),
                   key=lambda n: int(n.rpartition("-")[2]) if "-" in n else 0)
    handles = [ray.get_actor(n, namespace=namespace) for n in names]
    return ",".join(ray.get([h.address.remote() for h in handles], timeout=60))


@dataclass(frozen=True)
class ActorReport:
    name: str
    role: str
    node_id: str
    node_ip: str
    pid: int
    address: str  # gRPC host:port
    transfer_address: str  # "" for the Conductor
    ready: bool
    metrics_address: str = ""  # host:port of its /metrics ("" when off)


def _placed(role: str, config: Any, node_ip: str, namespace: str) -> Any:
    """``config`` for this node: bind and advertise the node's address (unless it names a bind
    host), find the Conductors through their actors, keep the SSD tier under ``data_dir/<worker
    id>``, use the GPU Ray assigned."""
    changes: dict[str, Any] = {}
    if config.host == "127.0.0.1":
        changes["host"] = node_ip
    if role != CONDUCTOR:
        changes["advertise_host"] = config.advertise_host or node_ip
        if not config.conductor:
            changes["conductor"] = conductor_addresses(namespace)
    if role in POOLS:
        if getattr(config, "data_dir", ""):  # one SSD tier per worker, kept across its restarts
            changes["data_dir"] = os.path.join(config.data_dir, config.worker_id)
        if config.device.startswith("cuda"):
            changes["device"] = "cuda"  # CUDA_VISIBLE_DEVICES holds the one GPU Ray gave this actor
    return dataclasses.replace(config, **changes)


@contextlib.contextmanager
def _secret_file(secret: str) -> Iterator[str]:
    """A path that reads as ``secret`` while the body runs: an anonymous in-memory file
    (``memfd``, mode 0600) named through ``/proc/<pid>/fd``, so nothing is ever on disk, and
    the kernel frees it when it is closed on leaving or when this process dies, SIGKILL
    included. Only this user can open another process's ``/proc/<pid>/fd``."""
    fd = os.memfd_create("tidekv-cluster-secret", os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secret.encode())
        yield f"/proc/{os.getpid()}/fd/{fd}"
    finally:
        os.close(fd)


def serve_at_normal_priority() -> None:
    """Ray starts its workers at niceness 15 (``RAY_worker_niceness``), below every ordinary
    process on the node, so a busy neighbour would starve a serving actor. Sets every thread of
    this process to niceness 0 where that is allowed (root, CAP_SYS_NICE), and otherwise says
    once how to start Ray instead; threads started later inherit it."""
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness <= 0:
        return
    try:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
    except PermissionError:
        log.warning("this actor runs at niceness %d (Ray's default for its workers), below every ordinary "
                    "process on this node; start Ray with RAY_worker_niceness=0 to serve at normal priority",
                    niceness)


class RoleActor:
    """One role's service in a Ray actor process (see the module docstring). Thread-safe: the
    actor runs with several threads so ``ready`` answers while ``drain`` blocks."""

    def __init__(self, role: str, config: Any, namespace: str, secret: str, cluster: RayClusterConfig | None = None):
        serve_at_normal_priority()
        setup_torch(getattr(config, "threads", 0) or 1)
        self.role, self.cluster, self._secret = role, cluster, secret
        self.node_ip = ray.util.get_node_ip_address()
        self.config = _placed(role, config, self.node_ip, namespace)
        parallel = role in POOLS and self.config.parallel_shape.world_size > 1
        if parallel:  # a rendezvous on this node, new at every (re)start; the ranks ask for it
            self.config = dataclasses.replace(self.config, dist_init=f"tcp://{self.node_ip}:{free_port(self.node_ip)}")
        build = importlib.import_module(BUILDERS[role]).build
        # The service reads the secret file while it is built (a worker: its credential) or
        # started (the Conductor), so the in-memory file is closed right after. A parallel rank
        # 0, which starts in the background, uses the credential it was built with.
        with contextlib.ExitStack() as reading:
            service_config = self.config
            if role != HTTP:  # the front signs nothing: it gets no secret (and is given "")
                service_config = dataclasses.replace(
                    service_config, cluster_secret_file=reading.enter_context(_secret_file(secret)))
            self.service = build(service_config)
            if not parallel:
                self.service.start()
        if parallel:  # the other ranks need the rendezvous before this one can finish starting
            threading.Thread(target=self.service.start, name="instance-start", daemon=True).start()

    def secret(self) -> str:
        """The cluster secret (the conductor actor's, for workers added later)."""
        return self._secret

    def dist_init(self) -> str:
        """The rendezvous of this instance's ranks ("" for an instance of one rank, or while this
        process is ending its instance: Ray's restart makes a new one)."""
        from runtime.ranks import failing

        return "" if failing() else getattr(self.config, "dist_init", "")

    def address(self) -> str:
        """The service's advertised address; a Conductor bound to a wildcard is dialled at its node's."""
        address = self.service.address
        if self.role == CONDUCTOR and self.config.host in WILDCARDS:
            address = f"{self.node_ip}:{address.rsplit(':', 1)[1]}"
        return address

    def ready(self) -> bool:
        """Started and able to take what comes next: for the Conductor, registrations (its own
        readiness waits for a live worker of each role, which register only after this)."""
        if self.role == CONDUCTOR:
            return bool(self.service.address)
        return self.service.ready()

    def report(self) -> ActorReport:
        ctx = ray.get_runtime_context()
        metrics = getattr(self.service, "metrics", None)
        return ActorReport(ctx.get_actor_name() or "", self.role, ctx.get_node_id(), self.node_ip, os.getpid(),
                           self.address(), getattr(self.service, "transfer_address", ""), self.service.ready(),
                           getattr(metrics, "address", ""))

    def workers(self) -> list[str]:
        """Worker ids the Conductor holds as registered and alive (the conductor actor only)."""
        return [info.worker_id for info, _ in self.service.cluster.alive()]

    def worker_states(self) -> tuple[WorkerState, ...]:
        """Each registered worker with its last heartbeat's load (the conductor actor only)."""
        resp = ipb.WorkersResponse()
        for info, load in self.service.cluster.alive():
            resp.workers.append(info)
            resp.loads.append(load)
        return workers_from_response(resp)

    def cluster_config(self) -> RayClusterConfig | None:
        return self.cluster

    def drain(self, timeout_s: float) -> None:
        self.service.drain(timeout_s)

    def stop(self) -> None:
        self.service.stop()


class RankActor:
    """A rank other than 0 of a worker instance (``runtime.ranks.serve_rank``), following rank
    0's schedule on a thread. It asks rank 0's actor (``leader``) for the rendezvous at every
    (re)start, until that actor names one (``leader_rendezvous``); when the instance loses a
    rank this process exits, and Ray restarts it into the instance's next start. The rank runs
    in this process, so it is given the cluster secret in memory: no file of it is ever written."""

    def __init__(self, role: str, config: Any, secret: str, leader: str, namespace: str):
        serve_at_normal_priority()
        setup_torch(getattr(config, "threads", 0) or 1)

        def ask() -> str:
            return ray.get(ray.get_actor(leader, namespace=namespace).dist_init.remote(), timeout=30)

        self.config = dataclasses.replace(config, dist_init=leader_rendezvous(ask, leader, RENDEZVOUS_WAIT_S))
        member = Member(secret.encode(), worker_principal(config.worker_id), config.tls)
        from runtime.ranks import serve_rank

        self._thread = threading.Thread(target=self._serve, args=(serve_rank, member), name="rank", daemon=True)
        self._thread.start()

    def _serve(self, serve_rank: Any, member: Member) -> None:
        serve_rank(self.config, member)  # returns when rank 0 stopped the instance; the launcher then kills this actor

    def alive(self) -> bool:
        return self._thread.is_alive()


RENDEZVOUS_WAIT_S = 300.0
RENDEZVOUS_POLL_S = 0.5


def leader_rendezvous(ask: Callable[[], str], leader: str, wait_s: float) -> str:
    """Rank 0's rendezvous, asked of its actor (``ask``) until it names one. A rank restarts while
    its rank 0 ends the instance or is itself restarted by Ray, so until then rank 0 answers ""
    (ending) or not at all (its process gone, or not yet rebuilt): both mean "ask again", not
    "give up"; an exception from the asking would fail this actor's creation, which Ray never
    retries, and leave the instance's next start waiting for a rank that is gone.
    RuntimeError once ``wait_s`` passes without an answer."""
    until, last = time.monotonic() + wait_s, "it answered that its instance is ending"
    while True:
        try:
            dist_init = ask()
            if dist_init:
                return dist_init
            last = "it answered that its instance is ending"
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ValueError) as e:
            last = f"{type(e).__name__}: {e}".splitlines()[0]  # ValueError: no such named actor (yet)
        if time.monotonic() > until:
            raise RuntimeError(f"rank 0's actor {leader} named no rendezvous within {wait_s:.0f} s; last: {last}")
        time.sleep(RENDEZVOUS_POLL_S)


@functools.cache
def remote_role_actor() -> Any:
    return ray.remote(RoleActor)


@functools.cache
def remote_rank_actor() -> Any:
    return ray.remote(RankActor)
