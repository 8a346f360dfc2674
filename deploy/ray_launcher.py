"""Tidekv on a Ray cluster: the three roles as Ray actors placed by resources.

What runs where (names in the Ray namespace ``config.namespace``, "tidekv" by default):

    conductor            detached actor: the Conductor service, public gRPC endpoint + registry
    conductor-R          with num_conductors > 1: replica R (1..N-1), sharing the cluster state
                         with the others through the store of ``conductor.index`` (redis://...)
    prefill-K-I          detached actor in bundle I of placement group "<ns>-prefill-gK" (PACK)
    decode-K-I           detached actor in bundle I of placement group "<ns>-decode-gK" (SPREAD)
    http                 detached actor: the OpenAI HTTP front (``openai_api``), unless num_http is 0

A role whose config makes each instance a group of ranks (``--tp``/``--ep``/``--cpp-stages``,
``runtime.ranks``) gets one placement group per instance, its bundles PACKed, one per rank:
``ROLE-K-0`` (rank 0, the instance) in bundle 0 and ``ROLE-K-0-rN`` (a ``RankActor``) in bundle
N. Rank 0 picks the rendezvous on its node (``tcp://NODE:PORT``) and starts in the background;
the launcher then starts the other ranks with it. A lost rank ends its instance
(``runtime.ranks.fail_fast``): every rank's actor exits, and Ray restarts each, which meet at the
same rendezvous again: the instance restarts as a whole.

Each actor is a ``RoleActor``: it builds its role's service (``build(config)``, see
``runtime.service``) and starts it in ``__init__``, so a restart by Ray (``max_restarts``)
builds a fresh one, which registers with the Conductor again under the same worker id. Every
actor binds and advertises its node's address (a role config that names another bind host,
such as 0.0.0.0, keeps it). A worker or front whose config names no Conductor asks the
Conductor actors for their addresses whenever it (re)starts, and is given them all
(comma-separated: it fails over between them). Replica R takes the config's port + R (and
metrics port + R) when they are fixed, so replicas that share a node do not collide.

A pool grows by a placement group per scale-up (one bundle per worker: ``CPU``, the role's
custom resources such as ``tidekv_prefill``, a ``GPU`` when the config says CUDA), filling free
bundles of its groups first; it shrinks newest first: drain, stop, kill, wait until the
Conductor has dropped the worker, and remove each group left empty. The launcher holds no
state of its own: ``RayCluster.attach`` (``tidekv scale``) rebuilds it from the named actors and
placement groups, and the cluster config is kept by the Conductor actor.

Every actor but the HTTP front (which signs nothing: it calls the Conductor's public endpoint
with its clients' API keys) gets the cluster secret (``runtime.auth``) as an argument and
writes it to a file of its own (mode 0600) for its service: the one in the Conductor config's
``cluster_secret_file`` when the driver has it, else a new one; the Conductor actor keeps it
for later scale-ups. Ray's own channels carry it, so whoever may drive the Ray cluster holds
it, as they can already run code in every actor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from conductor.config import ConductorConfig
from decode_worker.config import DecodeConfig
from deploy.cluster_state import Endpoint, WorkerState, format_endpoints, format_table, workers_from_response
from openai_api.config import FrontConfig
from prefill_worker.config import PrefillConfig
from proto import internal_pb2 as ipb
from runtime.auth import load_secret, new_secret
from runtime.ports import free_port
from runtime.settings import setup_torch

NAMESPACE = "tidekv"
CONDUCTOR = "conductor"  # replica 0's actor; replica R's is "conductor-R"
HTTP = "http"
POOLS = ("prefill", "decode")
BUILDERS = {"conductor": "conductor.server", "prefill": "prefill_worker.server", "decode": "decode_worker.server",
            "http": "openai_api.service"}
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
WILDCARDS = ("0.0.0.0", "::", "")
Resources = tuple[tuple[str, float], ...]


def parse_resources(text: str) -> Resources:
    """``"tidekv_prefill=1,node_type_a=0.01"`` -> ``(("tidekv_prefill", 1.0), ...)``; "" is none."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, amount = part.partition("=")
        try:
            if not (name and sep) or float(amount) <= 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"resource {part!r}: expected NAME=AMOUNT with AMOUNT > 0") from None
        out.append((name, float(amount)))
    return tuple(out)


@dataclass(frozen=True)
class Placement:
    """What each actor of a role asks Ray for; ``strategy`` spreads a pool group's bundles."""

    num_cpus: float = 0.25
    resources: Resources = ()
    strategy: str = "PACK"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"placement strategy {self.strategy!r} is not one of {STRATEGIES}")
        if self.num_cpus < 0:
            raise ValueError(f"num_cpus {self.num_cpus} < 0")

    def bundle(self, num_gpus: int) -> dict[str, float]:
        return {"CPU": self.num_cpus, **dict(self.resources), **({"GPU": float(num_gpus)} if num_gpus else {})}


@dataclass(frozen=True)
class RayClusterConfig:
    """A Tidekv cluster on Ray: each role's frozen config, pool sizes, placement and restarts.
    Worker configs with ``conductor=""`` find the Conductor through its actor."""

    conductor: ConductorConfig = ConductorConfig()
    prefill: PrefillConfig = PrefillConfig()
    decode: DecodeConfig = DecodeConfig()
    http: FrontConfig = FrontConfig()  # conductor "": the Conductor actor's address
    num_prefill: int = 1
    num_decode: int = 1
    num_http: int = 1  # 0: no HTTP front
    num_conductors: int = 1  # > 1: replicas over the shared state of conductor.index (redis://...)
    namespace: str = NAMESPACE
    conductor_placement: Placement = Placement(resources=(("tidekv_conductor", 1.0),))
    prefill_placement: Placement = Placement(resources=(("tidekv_prefill", 1.0),), strategy="PACK")
    decode_placement: Placement = Placement(resources=(("tidekv_decode", 1.0),), strategy="SPREAD")
    http_placement: Placement = Placement()  # anywhere: it holds no model weights
    max_restarts: int = 3  # per actor; -1: without limit
    ready_timeout_s: float = 180.0
    placement_timeout_s: float = 30.0
    extra: dict[str, Any] = field(default_factory=dict, hash=False)  # more actor options (runtime_env, ...)

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 0 or self.num_http not in (0, 1):
            raise ValueError(f"num_prefill {self.num_prefill} and num_decode {self.num_decode} must be >= 0, "
                             f"num_http {self.num_http} 0 or 1")
        if self.num_conductors < 1:
            raise ValueError(f"num_conductors {self.num_conductors} must be >= 1")
        if self.num_conductors > 1 and self.conductor.index == "memory":
            raise ValueError(f"num_conductors {self.num_conductors}: replicas share their state through a store "
                             "every node reaches: give the Conductor --index redis://HOST:PORT (or rediss://, "
                             "redis+sentinel://)")

    @property
    def conductor_names(self) -> tuple[str, ...]:
        return tuple(conductor_name(r) for r in range(self.num_conductors))

    def replica_config(self, replica: int) -> ConductorConfig:
        """Replica ``replica``'s Conductor config: fixed ports moved up by its number."""
        c = self.conductor
        return dataclasses.replace(c, port=c.port + replica if c.port else 0,
                                   metrics_port=c.metrics_port + replica if c.metrics_port > 0 else c.metrics_port)

    def role_config(self, role: str) -> Any:
        return getattr(self, role)

    def placement(self, role: str) -> Placement:
        return getattr(self, f"{role}_placement")

    def num_gpus(self, role: str) -> int:
        return 1 if getattr(self.role_config(role), "device", "cpu").startswith("cuda") else 0


def conductor_name(replica: int) -> str:
    return CONDUCTOR if replica == 0 else f"{CONDUCTOR}-{replica}"


_CONDUCTOR_NAME = re.compile(rf"{CONDUCTOR}(-[1-9]\d*)?")


def conductor_addresses(namespace: str) -> str:
    """Every running Conductor actor's address, comma-separated, replica 0 first."""
    names = sorted((a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["namespace"] == namespace and _CONDUCTOR_NAME.fullmatch(a["name"])),
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


class RoleActor:
    """One role's service in a Ray actor process (see the module docstring). Thread-safe: the
    actor runs with several threads so ``ready`` answers while ``drain`` blocks."""

    def __init__(self, role: str, config: Any, namespace: str, secret: str, cluster: RayClusterConfig | None = None):
        setup_torch(getattr(config, "threads", 0) or 1)
        self.role, self.cluster, self._secret = role, cluster, secret
        self.node_ip = ray.util.get_node_ip_address()
        self._secret_dir = ""
        if role != HTTP:  # the front signs nothing: it gets no secret (and is given "")
            self._secret_dir = tempfile.mkdtemp(prefix="tidekv-secret-")
            secret_file = os.path.join(self._secret_dir, "cluster.secret")
            with os.fdopen(os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(secret)
            config = dataclasses.replace(config, cluster_secret_file=secret_file)
        self.config = _placed(role, config, self.node_ip, namespace)
        parallel = role in POOLS and self.config.parallel_shape.world_size > 1
        if parallel:  # a rendezvous on this node, new at every (re)start; the ranks ask for it
            self.config = dataclasses.replace(self.config, dist_init=f"tcp://{self.node_ip}:{free_port(self.node_ip)}")
        self.service = importlib.import_module(BUILDERS[role]).build(self.config)
        if parallel:  # the other ranks need the rendezvous before this one can finish starting
            threading.Thread(target=self.service.start, name="instance-start", daemon=True).start()
        else:
            self.service.start()

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
        if self._secret_dir:
            shutil.rmtree(self._secret_dir, ignore_errors=True)


class RankActor:
    """A rank other than 0 of a worker instance (``runtime.ranks.serve_rank``), following rank
    0's schedule on a thread. It asks rank 0's actor (``leader``) for the rendezvous at every
    (re)start; when the instance loses a rank this process exits, and Ray restarts it into the
    instance's next start."""

    def __init__(self, role: str, config: Any, secret: str, leader: str, namespace: str):
        setup_torch(getattr(config, "threads", 0) or 1)
        dist_init, until = "", time.monotonic() + 300
        while not dist_init and time.monotonic() < until:  # "" from a rank 0 that is ending: wait for its restart
            dist_init = ray.get(ray.get_actor(leader, namespace=namespace).dist_init.remote(), timeout=300)
            time.sleep(0 if dist_init else 0.5)
        config = dataclasses.replace(config, dist_init=dist_init)
        self._secret_dir = tempfile.mkdtemp(prefix="tidekv-secret-")
        secret_file = os.path.join(self._secret_dir, "cluster.secret")
        with os.fdopen(os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(secret)
        self.config = dataclasses.replace(config, cluster_secret_file=secret_file)
        from runtime.ranks import serve_rank

        self._thread = threading.Thread(target=self._serve, args=(serve_rank,), name="rank", daemon=True)
        self._thread.start()

    def _serve(self, serve_rank: Any) -> None:
        serve_rank(self.config)  # returns when rank 0 stopped the instance; the launcher then kills this actor

    def alive(self) -> bool:
        return self._thread.is_alive()


@functools.cache
def _remote_role() -> Any:
    return ray.remote(RoleActor)


@functools.cache
def _remote_rank() -> Any:
    return ray.remote(RankActor)


def connect(address: str = "auto", namespace: str = NAMESPACE, **init_kwargs: Any) -> None:
    """Joins this process to the Ray cluster at ``address`` ("auto": the one this machine is in;
    "local": a new one for the life of this process) in the cluster's namespace."""
    ray.init(address=address, namespace=namespace, log_to_driver=False, **init_kwargs)


class RayCluster:
    """Starts, scales, reports and stops a Tidekv cluster on Ray; needs ``connect`` first."""

    def __init__(self, config: RayClusterConfig = RayClusterConfig()):
        self.config = config
        self.ns = config.namespace
        self.endpoint = ""
        self.http_url = ""  # the HTTP front's OpenAI base URL, "" without one
        self._cluster_secret = ""

    def _secret(self) -> str:
        """The cluster secret: the conductor actor's once it runs, else the config's file, else new."""
        if not self._cluster_secret:
            if CONDUCTOR in self._names():
                self._cluster_secret = ray.get(ray.get_actor(CONDUCTOR, namespace=self.ns).secret.remote(), timeout=60)
            elif self.config.conductor.cluster_secret_file:
                self._cluster_secret = load_secret(self.config.conductor.cluster_secret_file).decode()
            else:
                self._cluster_secret = new_secret()
        return self._cluster_secret

    @classmethod
    def attach(cls, namespace: str = NAMESPACE) -> RayCluster:
        """The cluster already running in ``namespace`` (``ValueError`` when there is none)."""
        try:
            conductor = ray.get_actor(CONDUCTOR, namespace=namespace)
        except ValueError:
            raise ValueError(f"no Tidekv cluster in Ray namespace {namespace!r}: start one with "
                             f"`tidekv up --ray`") from None
        cluster = cls(ray.get(conductor.cluster_config.remote(), timeout=60))
        cluster.endpoint = conductor_addresses(namespace)
        if HTTP in cluster._names():
            front = ray.get(ray.get_actor(HTTP, namespace=namespace).address.remote(), timeout=60)
            cluster.http_url = f"{'https' if cluster.config.http.tls.serves else 'http'}://{front}/v1"
        return cluster

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> RayCluster:
        """Conductors first (their addresses are the workers'), then the pools; returns when every
        actor is ready and registered. ``RuntimeError`` naming what did not come up (and all stopped)."""
        c = self.config
        if CONDUCTOR in self._names():
            raise ValueError(f"a Tidekv cluster already runs in Ray namespace {self.ns!r}: "
                             "`tidekv scale` it, or stop it first")
        try:
            conductors = {name: self._actor(name, CONDUCTOR, c.replica_config(r), None, None, cluster=c)
                          for r, name in enumerate(c.conductor_names)}
            self._wait_ready(conductors, registered=False)
            self.endpoint = conductor_addresses(self.ns)
            self.scale("prefill", c.num_prefill)
            self.scale("decode", c.num_decode)
            if c.num_http:
                front = self._actor(HTTP, HTTP, c.http, None, None)
                self._wait_ready({HTTP: front}, registered=False)
                self.http_url = f"{'https' if c.http.tls.serves else 'http'}://{ray.get(front.address.remote())}/v1"
        except BaseException:
            self.stop(grace_s=0)
            raise
        return self

    def stop(self, grace_s: float = 20.0) -> None:
        """Drains front to back (the HTTP front, then the Conductor, so its in-flight requests
        finish on live workers; then every worker), kills the actors and removes the placement groups."""
        names = self._names()
        if HTTP in names:
            self._retire({HTTP: ray.get_actor(HTTP, namespace=self.ns)}, grace_s)
        self._retire({n: ray.get_actor(n, namespace=self.ns) for n in names if _CONDUCTOR_NAME.fullmatch(n)}, grace_s)
        for role in POOLS:
            self._retire(self._pool(role), grace_s)
        for role in POOLS:
            for pg in self._groups(role).values():
                remove_placement_group(pg)

    # ---- pools --------------------------------------------------------------------------------
    def scale(self, role: str, count: int) -> None:
        """Resizes a pool to ``count`` workers: new ones are ready and registered when this
        returns; removed ones (newest first) have drained and left the Conductor's registry."""
        if role not in POOLS or count < 0:
            raise ValueError(f"scale {role!r} to {count}: role must be one of {POOLS}, count >= 0")
        live = self._pool(role)
        if count > len(live):
            self._grow(role, count - len(live), live)
        elif count < len(live):
            victims = dict(sorted(live.items(), key=lambda kv: _slot(kv[0]), reverse=True)[: len(live) - count])
            self._retire(victims, self.config.role_config(role).drain_timeout_s)
            self._wait_registry(lambda ids: not set(victims) & ids, f"{sorted(victims)} leave the registry")
            used = {_slot(n)[0] for n in self._pool(role)}
            for k, pg in self._groups(role).items():
                if k not in used:
                    remove_placement_group(pg)

    def _grow(self, role: str, num: int, live: dict[str, Any]) -> None:
        if self.config.role_config(role).parallel_shape.world_size > 1:
            return self._grow_instances(role, num)
        groups = self._groups(role)
        taken = {_slot(name) for name in live}
        slots = [(k, i) for k, pg in sorted(groups.items()) for i in range(pg.bundle_count) if (k, i) not in taken]
        slots = slots[:num]
        if len(slots) < num:
            k = max(groups, default=-1) + 1
            groups[k] = self._new_group(role, k, num - len(slots))
            slots += [(k, i) for i in range(num - len(slots))]
        new = {f"{role}-{k}-{i}": self._actor(f"{role}-{k}-{i}", role, self.config.role_config(role),
                                              groups[k], i) for k, i in slots}
        self._wait_ready(new, registered=True)

    def _grow_instances(self, role: str, num: int) -> None:
        """``num`` instances of a parallel shape: a placement group each (one bundle per rank,
        PACKed), rank 0 first, then the other ranks at its rendezvous."""
        config = self.config.role_config(role)
        world = config.parallel_shape.world_size
        groups = self._groups(role)
        new = {}
        for k in range(max(groups, default=-1) + 1, max(groups, default=-1) + 1 + num):
            groups[k] = pg = self._new_group(role, k, world, strategy="PACK")
            name = f"{role}-{k}-0"
            new[name] = self._actor(name, role, config, pg, 0)
            rank_config = dataclasses.replace(config, worker_id=config.worker_id or name)
            for rank in range(1, world):
                self._rank_actor(f"{name}-r{rank}", role, dataclasses.replace(rank_config, rank=rank), pg, rank)
        self._wait_ready(new, registered=True)

    def _rank_actor(self, name: str, role: str, config: Any, pg: PlacementGroup, bundle: int) -> Any:
        c, p = self.config, self.config.placement(role)
        options: dict[str, Any] = dict(
            name=name, namespace=self.ns, lifetime="detached", max_restarts=c.max_restarts, max_task_retries=0,
            num_cpus=p.num_cpus, num_gpus=c.num_gpus(role), resources=dict(p.resources), **c.extra,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle))
        return _remote_rank().options(**options).remote(role, config, self._secret(), name.rsplit("-r", 1)[0],
                                                        self.ns)

    def _new_group(self, role: str, k: int, num: int, strategy: str | None = None) -> PlacementGroup:
        p = self.config.placement(role)
        bundle = p.bundle(self.config.num_gpus(role))
        pg = placement_group([bundle] * num, strategy=strategy or p.strategy, name=f"{self.ns}-{role}-g{k}",
                             lifetime="detached")
        try:
            ray.get(pg.ready(), timeout=self.config.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(
                f"Ray cannot place {num} {role} bundle(s) {bundle} ({p.strategy}) within "
                f"{self.config.placement_timeout_s:.0f} s; free now: {ray.available_resources()}. Give nodes the "
                f"resources (`ray start --resources='{{\"tidekv_{role}\": 8}}'`) or change the role's placement"
            ) from None
        return pg

    def _actor(self, name: str, role: str, config: Any, pg: PlacementGroup | None, bundle: int | None,
               cluster: RayClusterConfig | None = None) -> Any:
        c, p = self.config, self.config.placement(role)
        options: dict[str, Any] = dict(
            name=name, namespace=self.ns, lifetime="detached", max_restarts=c.max_restarts, max_task_retries=0,
            max_concurrency=8, num_cpus=p.num_cpus, num_gpus=c.num_gpus(role), resources=dict(p.resources),
            **c.extra)
        if pg is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
        if role in POOLS and not config.worker_id:
            config = dataclasses.replace(config, worker_id=name)
        secret = "" if role == HTTP else self._secret()
        return _remote_role().options(**options).remote(role, config, self.ns, secret, cluster)

    def _retire(self, actors: dict[str, Any], grace_s: float) -> None:
        """Drain (in parallel), stop and kill ``actors`` (and their instances' other ranks, once
        rank 0 has stopped them); one that is already gone is skipped."""
        if not actors:
            return
        ranks = {n: ray.get_actor(n, namespace=self.ns) for n in self._names()
                 if any(n.startswith(f"{a}-r") for a in actors)}
        for refs in ([a.drain.remote(grace_s) for a in actors.values()], [a.stop.remote() for a in actors.values()]):
            for ref in refs:  # one dead or stuck is ended by the kill below all the same
                with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    ray.get(ref, timeout=grace_s + 30)
        for a in [*actors.values(), *ranks.values()]:
            with contextlib.suppress(ray.exceptions.RayActorError):
                ray.kill(a, no_restart=True)

    # ---- state and readiness ------------------------------------------------------------------
    def reports(self) -> list[ActorReport]:
        """Where every actor runs and what it serves; an actor that does not answer is left out."""
        names = self._names()
        actors = {n: ray.get_actor(n, namespace=self.ns) for n in sorted(names)
                  if n == HTTP or _CONDUCTOR_NAME.fullmatch(n)}
        for role in POOLS:
            actors |= self._pool(role)
        out = []
        for actor in actors.values():
            try:
                out.append(ray.get(actor.report.remote(), timeout=10))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
        order = (CONDUCTOR, *POOLS, HTTP)
        return sorted(out, key=lambda r: (order.index(r.role), _slot(r.name) if r.role in POOLS else (0, 0), r.name))

    def registered(self) -> set[str]:
        """Worker ids the Conductor (replica 0: the replicas share one state) holds as alive."""
        return set(ray.get(ray.get_actor(CONDUCTOR, namespace=self.ns).workers.remote(), timeout=10))

    def worker_states(self) -> tuple[WorkerState, ...]:
        """The registered workers and their loads, as the Conductor holds them."""
        return ray.get(ray.get_actor(CONDUCTOR, namespace=self.ns).worker_states.remote(), timeout=10)

    def _wait_ready(self, actors: dict[str, Any], registered: bool) -> None:
        until, pending, last_error = time.monotonic() + self.config.ready_timeout_s, dict(actors), ""
        while pending:
            for name, actor in list(pending.items()):
                try:
                    if ray.get(actor.ready.remote(), timeout=5):
                        del pending[name]
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                    last_error = f"{name}: {e}"
            if pending and time.monotonic() > until:
                raise RuntimeError(f"not ready within {self.config.ready_timeout_s:.0f} s: {sorted(pending)} "
                                   f"(last error: {last_error or 'none'}; an actor Ray cannot place waits for "
                                   f"its resources, free now: {ray.available_resources()})")
            if pending:
                time.sleep(0.5)
        if registered:
            self._wait_registry(lambda ids: set(actors) <= ids, f"{sorted(actors)} registered")

    def _wait_registry(self, done, what: str) -> None:
        until = time.monotonic() + self.config.ready_timeout_s
        while not done(self.registered()):
            if time.monotonic() > until:
                raise RuntimeError(f"not within {self.config.ready_timeout_s:.0f} s: {what}")
            time.sleep(0.25)

    def _names(self) -> set[str]:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == self.ns}

    def _pool(self, role: str) -> dict[str, Any]:
        pattern = re.compile(rf"{role}-\d+-\d+")
        return {n: ray.get_actor(n, namespace=self.ns) for n in self._names() if pattern.fullmatch(n)}

    def _groups(self, role: str) -> dict[int, PlacementGroup]:
        pattern = re.compile(rf"{re.escape(self.ns)}-{role}-g(\d+)")
        out = {}
        for info in ray.util.placement_group_table().values():
            m = pattern.fullmatch(info.get("name", ""))
            if m and info["state"] != "REMOVED":
                out[int(m.group(1))] = PlacementGroup(ray.PlacementGroupID.from_hex(info["placement_group_id"]))
        return out


def format_reports(reports: list[ActorReport]) -> str:
    """Two tables: each actor (``format_actors``), then every address of each (the table of
    ``tidekv up``: role, worker id, gRPC, transfer, metrics, HTTP)."""
    return "\n".join([*format_actors(reports), *format_endpoints(report_endpoints(reports))])


def format_actors(reports: list[ActorReport]) -> list[str]:
    """One row per actor: name, role, node, pid, readiness."""
    rows = [("ACTOR", "ROLE", "NODE", "PID", "READY")]
    rows += [(r.name, r.role, f"{r.node_ip} ({r.node_id[:8]})", str(r.pid), "yes" if r.ready else "NOT READY")
             for r in reports]
    return format_table(rows)


def report_endpoints(reports: list[ActorReport]) -> tuple[Endpoint, ...]:
    """Every actor's addresses; a worker's id is its actor's name, as is a Conductor replica's
    after the first (``conductor-1``)."""
    def row(r: ActorReport) -> Endpoint:
        if r.role == HTTP:  # the front serves its /metrics on its own port
            return Endpoint(HTTP, "", "", "", r.metrics_address or r.address.split("://", 1)[-1].split("/")[0],
                            r.address)
        return Endpoint(r.role, "" if r.name == CONDUCTOR else r.name, r.address, r.transfer_address,
                        r.metrics_address, "")

    return tuple(row(r) for r in reports)


def _slot(name: str) -> tuple[int, int]:
    """``"prefill-2-1"`` -> ``(2, 1)``: group and bundle of a worker actor."""
    _, k, i = name.rsplit("-", 2)
    return int(k), int(i)
