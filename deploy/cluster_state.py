"""The cluster state file: what a ``LocalCluster`` runs, for ``tidekv status`` and SIGUSR1.

``ClusterState`` is a frozen value: each supervised process (role, pid, status, restarts,
start time, last exit) and each worker the Conductor's Registry/Workers lists, with its load
and its addresses. ``endpoints`` names every address of the cluster (role, worker id, gRPC,
transfer, metrics, HTTP), and ``format_endpoints`` is the table ``tidekv up`` prints at start.
The cluster rewrites the file on every change with ``write_state`` (temp file + rename in the
same directory, so a reader sees the old state or the new one, never half a file);
``read_state`` parses it back into the same dataclasses, and ``format_state`` renders the
text both ``tidekv status`` and ``tidekv up``'s SIGUSR1 print.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from proto import internal_pb2 as ipb

STATE_VERSION = 1

# A process's status: running; waiting out its restart backoff; crashed too often and left
# down; stopped on purpose (stop(), a kill asked not to restart); exited and not restarted
# (exit 0 after a signal from outside, or a crash while the cluster does not supervise).
UP, RESTARTING, GIVEN_UP, STOPPED, EXITED = "up", "restarting", "given-up", "stopped", "exited"


@dataclass(frozen=True)
class ProcessState:
    name: str
    role: str
    pid: int
    status: str
    restarts: int
    started_at_s: float  # wall clock (time.time) of the current process's start
    last_exit: str  # "killed by SIGKILL", "exited with 1"; "" before the first exit


@dataclass(frozen=True)
class WorkerState:
    """One worker as the Conductor's registry lists it, with its last heartbeat's load."""

    worker_id: str
    role: str
    rpc_address: str
    num_queued: int
    num_running: int
    num_free_pages: int
    num_pages_total: int
    num_context_tokens: int
    transfer_address: str = ""  # its KV transfer receiver (tcp://, shm://)
    metrics_address: str = ""  # host:port of its /metrics ("" when off)


@dataclass(frozen=True)
class ClusterState:
    endpoint: str
    http_url: str
    log_dir: str
    supervisor_pid: int  # the process running the LocalCluster (``tidekv up``)
    updated_at_s: float
    processes: tuple[ProcessState, ...]
    workers: tuple[WorkerState, ...]
    workers_error: str  # why the registry could not be read ("" when it could)
    conductor_metrics: str = ""  # host:port of the Conductor's /metrics ("" when off; replicas: comma-separated)


@dataclass(frozen=True)
class Endpoint:
    """One process's addresses ("" where it has none of that kind)."""

    role: str  # conductor, prefill, decode, http
    worker_id: str
    grpc: str
    transfer: str
    metrics: str
    http: str


def endpoints(conductor_grpc: str, conductor_metrics: str, workers: tuple[WorkerState, ...],
              http_url: str = "") -> tuple[Endpoint, ...]:
    """Every address of a cluster: each Conductor's (``conductor_grpc`` and ``conductor_metrics``
    comma-separated for replicas; replica r > 0 is named ``conductor-r`` in the ID column), each
    registered worker's (as the registry lists them), the HTTP front's."""
    grpcs, metrics = conductor_grpc.split(","), conductor_metrics.split(",")
    metrics += [""] * (len(grpcs) - len(metrics))
    out = [Endpoint("conductor", f"conductor-{r}" if r else "", g, "", m, "")
           for r, (g, m) in enumerate(zip(grpcs, metrics, strict=False))]
    out += [Endpoint(w.role, w.worker_id, w.rpc_address, w.transfer_address, w.metrics_address, "") for w in workers]
    if http_url:  # the front serves its /metrics on its own port
        out.append(Endpoint("http", "", "", "", http_url.split("://", 1)[-1].removesuffix("/v1"), http_url))
    return tuple(out)


def format_endpoints(rows: tuple[Endpoint, ...]) -> list[str]:
    """The address table: one line per process, "-" where it has no address of a kind."""
    table = [("ROLE", "WORKER", "GRPC", "TRANSFER", "METRICS", "HTTP")]
    table += [tuple(v or "-" for v in (e.role, e.worker_id, e.grpc, e.transfer, e.metrics, e.http)) for e in rows]
    return format_table(table)


def workers_from_response(resp: ipb.WorkersResponse) -> tuple[WorkerState, ...]:
    """The typed view of a Registry/Workers answer (``workers`` and ``loads`` are parallel)."""
    loads = list(resp.loads) + [ipb.WorkerLoad()] * (len(resp.workers) - len(resp.loads))
    return tuple(WorkerState(w.worker_id, ipb.WorkerRole.Name(w.role).removeprefix("WORKER_ROLE_").lower(),
                             w.rpc_address, load.num_queued, load.num_running, load.num_free_pages,
                             w.num_pages_total, load.num_context_tokens, w.transfer_address, w.metrics_address)
                 for w, load in zip(resp.workers, loads, strict=True))


def write_state(path: Path, state: ClusterState) -> None:
    """Replaces ``path`` atomically with ``state`` as JSON. Raises OSError (disk full, ...)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(state_json(state))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_state(path: Path) -> ClusterState:
    """The state in ``path``; ValueError naming the file if it is missing or not a state file."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no cluster state at {path} (no `tidekv up` has written one there)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a cluster state file: {e}") from None
    if not isinstance(raw, dict) or raw.pop("version", None) != STATE_VERSION:
        raise ValueError(f"{path} is not a version-{STATE_VERSION} cluster state file")
    try:
        processes = tuple(ProcessState(**p) for p in raw.pop("processes"))
        workers = tuple(WorkerState(**w) for w in raw.pop("workers"))
        return ClusterState(**raw, processes=processes, workers=workers)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a cluster state file: {e}") from None


def state_json(state: ClusterState) -> str:
    return json.dumps({"version": STATE_VERSION, **asdict(state)}, indent=1)


def _duration(s: float) -> str:
    s = int(max(0.0, s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_table(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def format_workers(workers: tuple[WorkerState, ...]) -> list[str]:
    """The worker table: each registered worker's load, from its last heartbeat."""
    rows = [("WORKER", "ROLE", "QUEUED", "RUNNING", "FREE PAGES", "CONTEXT TOKENS", "ADDRESS")]
    rows += [(w.worker_id, w.role, str(w.num_queued), str(w.num_running),
              f"{w.num_free_pages}/{w.num_pages_total}", str(w.num_context_tokens), w.rpc_address)
             for w in workers]
    return format_table(rows) if workers else ["workers: none registered"]


def format_state(state: ClusterState, now_s: float, note: str = "") -> str:
    """The human view: a header, one row per process, one per registered worker, then every
    address."""
    http = f", HTTP {state.http_url}" if state.http_url else ""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.updated_at_s))
    lines = [f"tidekv cluster {state.endpoint}{http} (run by pid {state.supervisor_pid}; state of {when})"]
    if note:
        lines.append(note)
    rows = [("PROCESS", "ROLE", "PID", "STATUS", "RESTARTS", "UPTIME", "LAST EXIT")]
    rows += [(p.name, p.role, str(p.pid), p.status, str(p.restarts),
              _duration(now_s - p.started_at_s) if p.status == UP else "-", p.last_exit or "-")
             for p in state.processes]
    lines += format_table(rows)
    if state.workers_error:
        lines.append(f"workers: the Conductor's registry is not reachable ({state.workers_error})")
    else:
        lines += format_workers(state.workers)
    lines += format_endpoints(endpoints(state.endpoint, state.conductor_metrics, state.workers, state.http_url))
    lines.append(f"logs: {state.log_dir}")
    return "\n".join(lines)
