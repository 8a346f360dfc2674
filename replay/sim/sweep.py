"""``tidekv simulate --sweep``: every combination of cluster shapes and policies simulated on
the same requests, and the cheapest that meets the SLOs.

Owns the grid (``parse_sweep``), one row per shape (``shape_row``) and running the shapes
(``run_sweep``): in this process one after another (``jobs`` 1), or ``jobs`` at a time, each
in a process of its own. A run is deterministic (its draws come from generators seeded by
the worker ids, ``replay.sim.prefill``/``decode``), so the rows are the same either way but
for their ``wall_s``; in a pool each process receives the requests, the cost models and the
flags once (its initializer), then only the shapes. The processes are spawned, not forked
(the caller may hold threads or torch's state), and a sweep interrupted or failed stops the
shapes still running. Progress goes to stderr as each shape finishes, in whatever order.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from conductor.routing import policy_names
from costmodel import CostModels
from replay.progress import StatusLine
from replay.sim.run import SimConfig, SimResult, simulate

SWEEP_KEYS = ("prefill", "decode", "policy")
ROW_COLUMNS = (*SWEEP_KEYS, "attainment", "goodput_rps", "ttft_p50_s", "ttft_p90_s", "tbt_p90_s", "rejected",
               "cached_ratio")

# What a pool process simulates every shape on (``_init_worker``): the requests, cost models,
# the flags as a dict, and how a shape becomes a SimConfig.
_worker: dict[str, Any] = {}


def parse_sweep(items: list[str]) -> dict[str, list[str]]:
    """``["prefill=2,4", "policy=mooncake"]`` -> ``{"prefill": ["2", "4"], "policy": ["mooncake"]}``;
    every value checked here (worker counts >= 1, registered policies), so a bad one fails
    the sweep before any shape runs."""
    out: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or key not in SWEEP_KEYS or not values:
            raise ValueError(f"--sweep {item!r}: expected KEY=V1,V2 with KEY one of {', '.join(SWEEP_KEYS)}")
        out[key] = [x for x in values.split(",") if x]
        if key == "policy":
            known = policy_names()
            unknown = [x for x in out[key] if x not in known]
            if unknown:
                raise ValueError(f"--sweep {item!r}: unknown policy {unknown[0]!r}; registered: {', '.join(known)}")
        elif not all(x.isdigit() and int(x) >= 1 for x in out[key]):
            raise ValueError(f"--sweep {item!r}: {key} takes worker counts, integers >= 1")
    return out


def default_jobs() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def shape_row(shape: dict, result: SimResult) -> dict:
    s = result.summary
    return {**shape, "attainment": s.slo.attainment, "goodput_rps": s.slo.goodput_rps, "ttft_p50_s": s.ttft_s.p50,
            "ttft_p90_s": s.ttft_s.p90, "tbt_p90_s": s.tbt_s.p90, "rejected": s.counts.rejected,
            "cached_ratio": s.cache.ratio, "wall_s": result.stats["wall_s"]}


def _simulate_shape(scaled, costs: CostModels, flags: dict, make_config: Callable[..., SimConfig],
                    shape: dict) -> dict:
    result = simulate(scaled, make_config(flags, **shape), costs)
    return shape_row({k: shape[k] if k in shape else flags[k] for k in SWEEP_KEYS}, result)


def _init_worker(scaled, costs: CostModels, flags: dict, make_config: Callable[..., SimConfig]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the sweep's to handle: it stops the pool
    _worker.update(scaled=scaled, costs=costs, flags=flags, make_config=make_config)


def _run_in_worker(item: tuple[int, dict]) -> tuple[int, dict]:
    i, shape = item
    return i, _simulate_shape(_worker["scaled"], _worker["costs"], _worker["flags"], _worker["make_config"], shape)


def run_sweep(grid: dict[str, list[str]], scaled, costs: CostModels, flags: dict,
              make_config: Callable[..., SimConfig], min_attainment: float, jobs: int = 1
              ) -> tuple[list[dict], dict | None]:
    """Every shape of ``grid`` simulated (``make_config(flags, **shape)``; a module-level function,
    so that a pool can pickle it), ``jobs`` at a time; the rows in the grid's order and the
    cheapest (fewest workers, then the highest attainment) reaching ``min_attainment``."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    if not any(r.ttft_slo_s is not None or r.tbt_slo_s is not None for r in scaled.requests):
        raise ValueError("--sweep ranks shapes by SLO attainment, and no request has an SLO: "
                         "give --ttft-slo-s and/or --tbt-slo-s")
    keys = list(grid)
    shapes = [dict(zip(keys, values, strict=True)) for values in itertools.product(*(grid[k] for k in keys))]
    rows: list[dict | None] = [None] * len(shapes)

    status = StatusLine(sys.stderr, refresh_s=0.0, log_every_s=0.0)  # a line per shape, in place on a terminal

    def done(i: int, num_done: int) -> None:
        status.show(lambda: f"sweep {num_done}/{len(shapes)}: {shapes[i]} attainment {rows[i]['attainment']:.3f}")

    jobs = min(jobs, len(shapes))
    if jobs == 1:
        for i, shape in enumerate(shapes):
            rows[i] = _simulate_shape(scaled, costs, flags, make_config, shape)
            done(i, i + 1)
    else:
        print(f"sweep: {len(shapes)} shapes, {jobs} at a time", file=sys.stderr)
        pool = multiprocessing.get_context("spawn").Pool(jobs, _init_worker, (scaled, costs, flags, make_config))
        try:
            for num_done, (i, row) in enumerate(pool.imap_unordered(_run_in_worker, enumerate(shapes)), start=1):
                rows[i] = row
                done(i, num_done)
        except BaseException:
            pool.terminate()  # a shape failed or the sweep was interrupted: stop the ones still running
            raise
        else:
            pool.close()
        finally:
            pool.join()
    status.end()
    done_rows = [row for row in rows if row is not None]  # every one: a shape that failed raised above
    meeting = [r for r in done_rows if r["attainment"] >= min_attainment]
    best = min(meeting, key=lambda r: (int(r["prefill"]) + int(r["decode"]), -r["attainment"]), default=None)
    return done_rows, best


def print_rows(rows: list[dict]) -> None:
    print(" | ".join(ROW_COLUMNS))
    for r in rows:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in ROW_COLUMNS))
