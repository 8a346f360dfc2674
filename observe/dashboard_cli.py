"""``tidekv dashboard``'s command line: its flags, and the run that hands them to
``observe.snapshots.snapshot``. Kept apart from the renderer so that building the ``tidekv``
parser (every subcommand's, ``tidekv simulate``'s included) does not import matplotlib."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "deploy" / "grafana"


def add_dashboard_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``tidekv dashboard``; the parsed namespace's ``func(args)`` runs it."""
    p = subparsers.add_parser("dashboard", help="render the Grafana dashboards' panels as PNGs from a Prometheus")
    p.add_argument("--snapshot", required=True, metavar="DIR", help="directory for the PNGs")
    p.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    p.add_argument("--dashboards", default=str(DEFAULT_DIR), help="directory of dashboard JSON")
    p.add_argument("--range", dest="range_s", type=float, default=900.0, help="seconds of history (default 900)")
    p.add_argument("--step", dest="step_s", type=float, default=15.0, help="seconds between points (default 15)")
    p.set_defaults(func=run_dashboard)
    return p


def run_dashboard(args: argparse.Namespace) -> int:
    from observe.snapshots import snapshot

    rendered = snapshot(args.prometheus, args.snapshot, args.dashboards, args.range_s, args.step_s)
    for r in rendered:
        note = "" if r.num_points else "  (no data)"
        print(f"{r.path}  {r.num_series} series, {r.num_points} points{note}", flush=True)
    empty = sum(not r.num_points for r in rendered)
    print(f"{len(rendered)} panels rendered to {args.snapshot}; {empty} without data", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``main(["dashboard", ...])``: the subcommand alone, as ``tidekv`` would parse it."""
    parser = argparse.ArgumentParser(prog="tidekv")
    add_dashboard_parser(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main(["dashboard", *sys.argv[1:]]))
