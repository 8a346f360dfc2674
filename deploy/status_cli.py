"""``tidekv status``, and where ``tidekv up`` keeps the logs and state it is read from.

A ``tidekv up`` with ``--data-dir DIR`` keeps its logs in ``DIR/logs`` and its state in
``DIR/state.json``; without one, in ``~/.cache/tidekv/up/<start time>-<pid>/`` (its SSD
tiers stay in a temporary directory), of which the newest ``UP_RUNS_KEPT`` runs are kept.
A ``tidekv up --ray`` leaves ``ray.json`` there instead (``deploy/ray_status.py``): where its
Ray cluster is. ``tidekv status`` prints a state file (``deploy/cluster_state.py``) as text or
JSON, or, for a run on Ray (or ``--ray ADDRESS``), the Ray cluster's actors read live; SIGUSR1
makes a running ``tidekv up`` print the same, live. ``find_metrics`` gives ``tidekv top`` the
newest run's metrics addresses.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from deploy.cluster_state import format_state, read_state, state_json
from deploy.ray_status import RAY_RUN_FILE, format_ray_status, read_ray_run, read_ray_status, supervisor_note
from runtime.private import private_dir

UP_RUNS_DIR = Path("~/.cache/tidekv/up")
UP_RUNS_KEPT = 20


def new_up_run_dir() -> Path:
    """Makes UP_RUNS_DIR/<start time>-<pid> and removes the runs older than the newest UP_RUNS_KEPT."""
    runs = UP_RUNS_DIR.expanduser()
    run_dir = runs / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    private_dir(run_dir)  # its logs and state are the owner's only
    for old in sorted(p for p in runs.iterdir() if p.is_dir())[:-UP_RUNS_KEPT]:
        shutil.rmtree(old, ignore_errors=True)
    return run_dir


def print_state_on_sigusr1(cluster) -> None:
    """Installs a SIGUSR1 handler that prints ``cluster``'s state (a ``LocalCluster``) to
    stderr, from a thread: the registry call must not run inside the handler, which
    interrupts the main thread wherever it is."""

    def show() -> None:
        print(format_state(cluster.state(refresh_workers=True), time.time()), file=sys.stderr, flush=True)

    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=show, daemon=True).start())


def run_file(state: str = "", data_dir: str = "") -> Path:
    """The file a run is read from: ``state`` (a state.json or a ray.json), else DIR's, else
    the newest run's under UP_RUNS_DIR. ValueError when there is none."""
    if state:
        return Path(state)
    if data_dir:
        found = [p for p in (Path(data_dir) / "state.json", Path(data_dir) / RAY_RUN_FILE) if p.exists()]
        if not found:
            raise ValueError(f"no cluster state in {data_dir} (neither state.json nor {RAY_RUN_FILE})")
        return found[0]
    runs = sorted([*UP_RUNS_DIR.expanduser().glob("*/state.json"), *UP_RUNS_DIR.expanduser().glob(f"*/{RAY_RUN_FILE}")],
                  key=lambda p: p.parent.name)
    if not runs:
        raise ValueError(f"no `tidekv up` run in {UP_RUNS_DIR}: give the cluster's --data-dir, or say where it is "
                         f"(see --help)")
    return runs[-1]


def find_metrics(state: str = "", data_dir: str = "") -> tuple[str, list[str]]:
    """The Conductor's and every worker's /metrics address of a run (``run_file``)."""
    path = run_file(state, data_dir)
    if path.name == RAY_RUN_FILE:
        run = read_ray_run(path)
        status = read_ray_status(run.ray_address, run.namespace, run.auth_mode)
        by_role = [(r.role, r.metrics_address) for r in status.actors if r.metrics_address]
    else:
        found = read_state(path)
        by_role = [("conductor", a) for a in found.conductor_metrics.split(",")]  # the first replica's is used
        by_role += [(w.role, w.metrics_address) for w in found.workers]
    conductor = next((a for role, a in by_role if role == "conductor" and a), "")
    if not conductor:
        raise ValueError(f"the cluster of {path} names no metrics address of its Conductor: give --endpoint")
    return conductor, [a for role, a in by_role if role != "conductor" and a]


def _cmd_status(args: argparse.Namespace) -> int:
    if args.ray:
        status = read_ray_status(args.ray, args.namespace)
        print(status.to_json() if args.json else format_ray_status(status))
        return 0
    path = run_file(args.state, args.data_dir)
    if path.name == RAY_RUN_FILE:
        run = read_ray_run(path)
        status = read_ray_status(run.ray_address, run.namespace, run.auth_mode)
        print(status.to_json() if args.json else format_ray_status(status, supervisor_note(run)))
        return 0
    state = read_state(path)
    if args.json:
        print(state_json(state))
        return 0
    note = ""
    try:
        os.kill(state.supervisor_pid, 0)
    except ProcessLookupError:
        note = f"(pid {state.supervisor_pid} is not running: this is the last state it wrote)"
    except PermissionError:  # alive, another user's
        pass
    print(format_state(state, time.time(), note))
    return 0


def add_status_parser(sub: argparse._SubParsersAction) -> None:
    status = sub.add_parser("status", help="the processes, workers and addresses of a `tidekv up` cluster: from its "
                                           "state file, or read live from Ray")
    where = status.add_mutually_exclusive_group()
    where.add_argument("--data-dir", default="", help="the --data-dir the cluster was started with")
    where.add_argument("--state", default="", metavar="FILE",
                       help=f"a state file or a ray.json (default: the newest run's in {UP_RUNS_DIR})")
    where.add_argument("--ray", default="", metavar="ADDRESS",
                       help="read the Tidekv cluster on the Ray cluster at ADDRESS (host:port, or auto)")
    status.add_argument("--namespace", default="tidekv", help="--ray: the Ray namespace of the actors")
    status.add_argument("--json", action="store_true", help="the state file's JSON instead of text")
    status.set_defaults(func=_cmd_status)
