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

A pool grows by a placement group per scale-up (one bundle per worker: ``CPU``, the role's
custom resources such as ``tidekv_prefill``, a ``GPU`` when the config says CUDA), filling free
bundles of its groups first; it shrinks newest first: drain, stop, kill, wait until the
Conductor has dropped the worker, and remove each group left empty. The launcher holds no
state of its own: ``RayCluster.attach`` (``tidekv scale``) rebuilds it from the named actors and
placement groups, and the cluster config is kept by the Conductor actor.

The pieces: ``deploy.ray_config`` (the cluster as data), ``deploy.ray_actors`` (the actors) and
this module (``RayCluster``: start, scale, attach, report, stop).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deploy.cluster_state import Endpoint, WorkerState, format_endpoints, format_table
from deploy.ray_actors import ActorReport, conductor_addresses, remote_rank_actor, remote_role_actor
from deploy.ray_config import (
    CONDUCTOR,
    CONDUCTOR_NAMES,
    HTTP,
    NAMESPACE,
    POOLS,
    Placement,
    RayClusterConfig,
    parse_resources,
)
from runtime.auth import load_secret, new_secret

__all__ = ["Placement", "RayCluster", "RayClusterConfig", "connect", "format_reports", "parse_resources"]


def connect(address: str = "auto", namespace: str = NAMESPACE, **init_kwargs: Any) -> None:
    """Joins this process to the Ray cluster at ``address`` ("auto": the one this machine is in;
    "local": a new one for the life of this process) in the cluster's namespace."""
    ray.init(address=address, namespace=namespace, log_to_driver=False, **init_kwargs)


class RayCluster:
    """Starts, scales, reports and stops a Tidekv cluster on Ray; needs ``connect`` first."""

    def __init__(self, config: RayClusterConfig | None = None):
        self.config = config = config or RayClusterConfig()
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
        self._retire({n: ray.get_actor(n, namespace=self.ns) for n in names if CONDUCTOR_NAMES.fullmatch(n)}, grace_s)
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
        return remote_rank_actor().options(**options).remote(role, config, self._secret(), name.rsplit("-r", 1)[0],
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
        return remote_role_actor().options(**options).remote(role, config, self.ns, secret, cluster)

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
                  if n == HTTP or CONDUCTOR_NAMES.fullmatch(n)}
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
