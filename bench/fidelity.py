"""Simulator fidelity: one scaled window of the Mooncake synthetic trace, replayed live against
a local cluster and simulated with a calibration made on this machine in the same run.
Prints one JSON object (progress on stderr): TTFT p50/p90 and TBT p50 of both and the
simulator's relative error (goal: within 10%; Vidur reports under 9% on real GPUs), plus the
two report directories' paths when --keep is given.

Usage: python -m bench.fidelity [--quick] [--requests 80] [--rate-scale 1.0] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conductor.config import ConductorConfig
from costmodel import CostModels
from decode_worker.config import DecodeConfig
from deploy.local import ClusterConfig, LocalCluster
from prefill_worker.config import PrefillConfig
from replay.live import run_live_replay
from replay.report import write_report
from replay.sim.run import SimConfig, simulate
from replay.traces import read_trace
from replay.transform import TraceTransform, apply_transform

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"
# The trace's 120-request window with the most reuse inside it (54% of blocks): a replay starts
# with a cold cache, so a window that mostly reuses earlier requests would show no reuse at all.
WINDOW_START = 3840
BLOCK, SNAPSHOT_EVERY, PREFILL_PAGES, DECODE_PAGES = 16, 2, 2048, 4096


def log(msg: str) -> None:
    print(f"[fidelity] {msg}", file=sys.stderr, flush=True)


def rel(sim: float | None, live: float | None) -> float | None:
    return None if sim is None or not live else (sim - live) / live


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--keep", default="", help="keep the calibration and both reports here")
    args = p.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tidekv-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    calibration = work / "calibration.json"
    grid = "smoke" if args.quick else "quick"
    log(f"calibrating ({grid} grid)")
    subprocess.run([sys.executable, "-m", "deploy.cli", "calibrate", "--model", "tiny", "--grid", grid,
                    "--block-size", str(BLOCK), "--snapshot-interval-blocks", str(SNAPSHOT_EVERY), "--out",
                    str(calibration)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    n = 30 if args.quick else args.requests
    transform = TraceTransform(block_size=BLOCK, output_scale=0.1, max_output_tokens=32, rate_scale=args.rate_scale,
                               index_start=WINDOW_START, index_end=WINDOW_START + n)
    scaled = apply_transform(read_trace(TRACE), transform)
    worker = ("--block-size", str(BLOCK), "--snapshot-interval-blocks", str(SNAPSHOT_EVERY))
    log(f"live replay of {len(scaled.requests)} requests")
    config = ClusterConfig(num_prefill=1, num_decode=1, calibration=str(calibration),
                           prefill_args=(*worker, "--num-pages", str(PREFILL_PAGES)),
                           decode_args=("--block-size", str(BLOCK), "--num-pages", str(DECODE_PAGES)))
    with LocalCluster(config) as c:
        time.sleep(1.0)
        live = run_live_replay(scaled, c.endpoint, max_concurrency=64, out_dir=work / "live", plots=False,
                               progress=False).summary
    log("simulating the same window")
    sim_config = SimConfig(1, 1, ConductorConfig(),
                           PrefillConfig(block_size=BLOCK, snapshot_interval_blocks=SNAPSHOT_EVERY,
                                         num_pages=PREFILL_PAGES),
                           DecodeConfig(block_size=BLOCK, num_pages=DECODE_PAGES))
    result = simulate(apply_transform(read_trace(TRACE), transform, materialise=False), sim_config,
                      CostModels.load(calibration))
    write_report(work / "sim", result.records, result.summary, plots=False)
    sim = result.summary
    rows = {
        "ttft_p50_s": (live.ttft_s.p50, sim.ttft_s.p50), "ttft_p90_s": (live.ttft_s.p90, sim.ttft_s.p90),
        "tbt_p50_s": (live.tbt_s.p50, sim.tbt_s.p50), "cached_ratio": (live.cache.ratio, sim.cache.ratio),
        "finished": (live.counts.finished, sim.counts.finished),
    }
    out = {"window": f"requests {WINDOW_START}..{WINDOW_START + n}, rate x{args.rate_scale}, block {BLOCK}",
           "metrics": {k: {"live": a, "simulated": b, "relative_error": rel(b, a)} for k, (a, b) in rows.items()},
           "goal_abs_relative_error": 0.10, "reports": str(work) if args.keep else None}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
