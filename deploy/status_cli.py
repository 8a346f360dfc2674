"""``tidekv status``, and where ``tidekv up`` keeps the logs and state it is read from.

A ``tidekv up`` with ``--data-dir DIR`` keeps its logs in ``DIR/logs`` and its state in
``DIR/state.json``; without one, in ``~/.cache/tidekv/up/<start time>-<pid>/`` (its SSD
tiers stay in a temporary directory), of which the newest ``UP_RUNS_KEPT`` runs are kept.
``tidekv status`` prints a state file (``deploy/cluster_state.py``) as text or JSON;
SIGUSR1 makes a running ``tidekv up`` print the same, live.
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


def _state_path(args: argparse.Namespace) -> Path:
    """--state, else DIR/state.json, else the newest run's under UP_RUNS_DIR."""
    if args.state:
        return Path(args.state)
    if args.data_dir:
        return Path(args.data_dir) / "state.json"
    runs = sorted(UP_RUNS_DIR.expanduser().glob("*/state.json"))
    if not runs:
        raise ValueError(f"no `tidekv up` run in {UP_RUNS_DIR}: give --data-dir DIR or --state FILE")
    return runs[-1]


def _cmd_status(args: argparse.Namespace) -> int:
    state = read_state(_state_path(args))
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
    status = sub.add_parser("status", help="the processes and workers of a `tidekv up` cluster, from its state file")
    where = status.add_mutually_exclusive_group()
    where.add_argument("--data-dir", default="", help="the --data-dir the cluster was started with")
    where.add_argument("--state", default="", metavar="FILE",
                       help=f"a state file (default: the newest run's in {UP_RUNS_DIR})")
    status.add_argument("--json", action="store_true", help="the state file's JSON instead of text")
    status.set_defaults(func=_cmd_status)
