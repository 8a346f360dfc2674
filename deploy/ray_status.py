"""What ``tidekv status`` and ``tidekv top`` know of a Tidekv cluster on Ray.

``tidekv up --ray`` leaves a ``ray.json`` in its run directory (``write_ray_run``): the Ray
cluster's address and the namespace of the actors, so a later ``tidekv status`` finds the
cluster the way it finds a local one's state file. ``read_ray_status`` joins that Ray cluster
as a driver and asks the actors themselves (``RayCluster.attach``): each actor's node, pid,
readiness and addresses, and the Conductor's registry with each worker's load. Nothing is
kept: every call reads the cluster as it is. Ray is imported only here, when a Ray cluster is
asked about.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deploy.cluster_state import WorkerState, format_endpoints, format_workers

RAY_RUN_FILE = "ray.json"
RAY_RUN_VERSION = 1


@dataclass(frozen=True)
class RayRun:
    """Where a ``tidekv up --ray`` cluster runs."""

    ray_address: str  # the Ray cluster's GCS address, host:port
    namespace: str
    endpoint: str  # the Conductor's public gRPC address
    supervisor_pid: int  # the ``tidekv up`` that started it (gone after --detach)
    started_at_s: float
    auth_mode: str = ""  # "token" when the Ray cluster takes token authentication (RAY_AUTH_MODE)


def write_ray_run(run_dir: Path, run: RayRun) -> Path:
    """Writes ``run_dir/ray.json`` (creating the directory); returns its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RAY_RUN_FILE
    path.write_text(json.dumps({"version": RAY_RUN_VERSION, **asdict(run)}, indent=1) + "\n")
    return path


def read_ray_run(path: Path) -> RayRun:
    """The run in ``path``; ValueError naming the file when it is not one."""
    try:
        raw = json.loads(path.read_text())
        if raw.pop("version") != RAY_RUN_VERSION:
            raise ValueError
        return RayRun(**raw)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{path} is not a version-{RAY_RUN_VERSION} `tidekv up --ray` run file") from None


@dataclass(frozen=True)
class RayStatus:
    ray_address: str
    namespace: str
    endpoint: str
    actors: tuple[Any, ...]  # ray_actors.ActorReport, Conductor first
    workers: tuple[WorkerState, ...]
    workers_error: str  # why the Conductor's registry could not be read ("" when it could)
    read_at_s: float

    def to_json(self) -> str:
        return json.dumps({"kind": "ray", **asdict(self)}, indent=1)


def current_auth_mode() -> str:
    """"token" when this driver's Ray cluster takes token authentication, else ""."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return "token" if is_token_auth_enabled() else ""


def read_ray_status(ray_address: str, namespace: str, auth_mode: str = "") -> RayStatus:
    """Joins the Ray cluster at ``ray_address`` and reads the Tidekv cluster in ``namespace``
    (ValueError when there is none); leaves the Ray cluster as it was. ``auth_mode`` "token":
    the cluster takes token authentication (a driver joining it must say so before Ray is
    imported; the token is Ray's own, in $RAY_AUTH_TOKEN or ~/.ray/auth_token)."""
    if auth_mode:
        os.environ.setdefault("RAY_AUTH_MODE", auth_mode)
    import ray

    from deploy.ray_launcher import RayCluster, connect

    try:
        connect(ray_address, namespace)
    except ConnectionError as e:  # no Ray there, or one that wants a token this driver lacks
        raise ValueError(f"cannot join the Ray cluster at {ray_address}: {e} (a cluster with token "
                         f"authentication needs RAY_AUTH_MODE=token and its token)") from None
    try:
        cluster = RayCluster.attach(namespace)
        actors = tuple(cluster.reports())
        try:
            workers, error = cluster.worker_states(), ""
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            workers, error = (), f"the conductor actor did not answer: {type(e).__name__}"
        return RayStatus(ray_address, namespace, cluster.endpoint, actors, tuple(workers), error, time.time())
    finally:
        ray.shutdown()


def format_ray_status(status: RayStatus, note: str = "") -> str:
    """The human view: a header, each actor, each registered worker's load, every address."""
    from deploy.ray_launcher import format_actors, report_endpoints

    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(status.read_at_s))
    lines = [f"tidekv cluster {status.endpoint} on Ray {status.ray_address} (namespace {status.namespace}; "
             f"read at {when})"]
    if note:
        lines.append(note)
    lines += format_actors(list(status.actors))
    if status.workers_error:
        lines.append(f"workers: {status.workers_error}")
    else:
        lines += format_workers(status.workers)
    lines += format_endpoints(report_endpoints(list(status.actors)))
    return "\n".join(lines)


def supervisor_note(run: RayRun) -> str:
    """Says when the ``tidekv up`` that started the cluster has gone (``--detach``, or it died)."""
    try:
        os.kill(run.supervisor_pid, 0)
    except ProcessLookupError:
        return f"(started by pid {run.supervisor_pid}, which has exited; the actors are read live)"
    except PermissionError:
        pass
    return ""
