"""The simulator at scale, with NVIDIA Dynamo's offline replay as the baseline in the same run.
Prints one JSON object; progress goes to stderr; writes the oscillation plot next to it.

1. Speed and cache: the Mooncake synthetic trace (3,993 requests) and a long-prompt trace made
   from it (every prompt 8x longer with the same hash structure: hash id ``h`` becomes the 8
   ids ``8h .. 8h+7``), at the trace's rate: ``--repeats`` alternating runs of
   ``dynamo.replay.api.run_trace_replay(num_workers=8, router_mode="kv_router")`` on the file
   (``ai-dynamo==1.6.1`` + ``ai-dynamo-runtime==1.6.1`` installed with ``pip install
   --no-deps``; reported as unavailable otherwise) and of Tidekv on 4+4 and 8+8 workers
   (reading the same file, transform, ``simulate`` with its summary), wall and CPU seconds,
   medians with min and max; ``speedup_over_dynamo`` is Dynamo's median wall over Tidekv's
   (goal >= 1.5), ``speedup_over_dynamo_cpu`` the same in CPU seconds (steadier on a shared
   host). Cached-token ratios of both.
5. ``--big N`` (not by default: it takes a long while): N requests of the synthetic trace
   tiled (``TiledTrace``: back-to-back copies with their own hash ids) at 16x its rate on
   128 prefill + 128 decode workers with bounded tiers, records streamed to a report
   directory (``ReportWriter``): wall and CPU time, peak RSS, and the RSS every tenth of the
   run (flat: memory does not grow with the number of requests).
2. Policies on the synthetic trace (8 prefill + 8 decode): goodput, TTFT mean/p50/p90, TBT p90,
   rejections, cached-token ratio; FAST'25 Fig. 5's ordering of mean TTFT.
3. Plain vs prediction-based early rejection (decode-bound: 8 + 2 workers at 3x the rate):
   rejections, goodput, variance of the prefill and decode load series, and a PNG of both
   series (``--plot``).
4. A sweep (prefill 4/8, decode 2/4/8, mooncake): the cheapest shape meeting the SLOs, run one
   shape after another (the baseline) and as ``tidekv simulate --sweep`` runs it (a process
   per CPU): both walls, the speedup, and whether the rows agree.

The tiny CPU model cannot serve this trace at its rate, so these runs use an analytic cost
model of a GPU-class instance (10k prefill tokens/s, 20 ms + 0.5 ms per request decode step;
stated in the output); ``--calibration FILE`` uses a measured one instead.

Usage: python -m bench.simulate [--quick] [--repeats 3] [--plot oscillation.png] [--calibration FILE]
                                [--big 1000000] [--only speed|big|sweep]
The machine this runs on may be shared: compare within one run (the ratios), not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from conductor.config import ConductorConfig
from costmodel import CostModels, load_models
from decode_worker.config import DecodeConfig
from prefill_worker.config import PrefillConfig
from replay.records import RequestRecord
from replay.report import ReportWriter
from replay.sim.run import SimConfig, simulate
from replay.sim.sweep import default_jobs, run_sweep
from replay.summary import Summary
from replay.traces import SYNTHETIC_TRACE, read_trace
from replay.transform import TiledTrace, TraceTransform, apply_transform

ROOT = Path(__file__).resolve().parents[1]
TRACE = SYNTHETIC_TRACE
GPU_LIKE = dict(prefill_s_per_token=1e-4, decode_base_s=0.02, decode_s_per_request=5e-4,
                decode_s_per_context_token=0.0, kv_bytes_per_token=1280, snapshot_bytes=300_000,
                transfer_bytes_per_s=5e9)
DECODE = DecodeConfig(num_pages=10**6, num_slots=1000, max_batch=256)
# A GPU-class instance keeps tens of GB of KV in device memory, not the CPU worker's default
# 256 MiB: with that, 512-token blocks (0.8 MB with their snapshots) churn between the device
# tier and DRAM on every prefill, which leaves every figure as it is and doubles the wall time.
PREFILL = PrefillConfig(device_bytes=40 << 30, dram_bytes=10**13, ssd_bytes=0)
SLO = dict(ttft_slo_s=10.0, tbt_slo_s=0.2)


def log(msg: str) -> None:
    print(f"[simulate] {msg}", file=sys.stderr, flush=True)


def scaled(path: Path, rate: float = 1.0, slo: dict | None = None):
    t = TraceTransform(block_size=512, max_prompt_tokens=10**7, rate_scale=rate, **(slo or {}))
    return apply_transform(read_trace(path), t, materialise=False)


def conductor(policy: str, **kw) -> ConductorConfig:
    return ConductorConfig(policy=policy, max_running=10**6, max_queued=10**6, **kw)


def long_prompt_trace(out: Path, factor: int = 8) -> Path:
    """The synthetic trace with every prompt ``factor`` times longer and the same hash
    structure: hash id ``h`` becomes ``factor`` ids ``factor*h .. factor*h + factor-1``, so two
    prompts share exactly ``factor`` times the blocks they shared."""
    trace = read_trace(TRACE)
    with out.open("w") as f:
        for r in trace.requests:
            f.write(json.dumps({"timestamp": r.arrival_s * 1000.0, "input_length": r.input_len * factor,
                                "output_length": r.output_len,
                                "hash_ids": [h * factor + j for h in r.hash_ids for j in range(factor)]}) + "\n")
    return out


def dynamo_replay(path: Path) -> dict:
    os.environ.setdefault("RUST_LOG", "error")
    os.environ.setdefault("DYN_LOG", "error")
    try:
        from dynamo.replay.api import run_trace_replay
    except ImportError as e:
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}
    t0, c0 = time.perf_counter(), time.process_time()
    report = run_trace_replay([str(path)], num_workers=8, router_mode="kv_router", arrival_speedup_ratio=1.0,
                              trace_block_size=512)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = report.to_dict()["summary"] if hasattr(report, "to_dict") else report["summary"]
    return {"available": True, "wall_s": wall, "cpu_s": cpu, "runtime_wall_s": s["wall_time_ms"] / 1e3,
            "cached_ratio": s["prefix_cache_reused_ratio"], "mean_ttft_s": s["mean_ttft_ms"] / 1e3,
            "num_requests": s["num_requests"]}


def tidekv_replay(path: Path, costs: CostModels, num: int) -> dict:
    """What Dynamo's call does, the Tidekv way: read the file, transform, simulate, summarise."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = simulate(scaled(path), SimConfig(num, num, conductor("mooncake"), PREFILL, DECODE), costs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall_s": wall, "cpu_s": cpu, "loop_wall_s": result.stats["wall_s"],
            "cached_ratio": result.summary.cache.ratio, "mean_ttft_s": result.summary.ttft_s.mean,
            "num_requests": result.summary.counts.total}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def speed(costs: CostModels, paths: dict[str, Path], repeats: int) -> dict:
    """Alternating runs (Dynamo, Tidekv 4+4, Tidekv 8+8) ``repeats`` times per trace."""
    out = {}
    for name, path in paths.items():
        runs: dict[str, list[dict]] = {"dynamo_8_workers": [], "tidekv_4p4d": [], "tidekv_8p8d": []}
        for i in range(repeats):
            log(f"speed: {name}, round {i + 1}/{repeats}")
            runs["dynamo_8_workers"].append(dynamo_replay(path))
            for num in (4, 8):
                runs[f"tidekv_{num}p{num}d"].append(tidekv_replay(path, costs, num))
        row: dict = {"num_requests": runs["tidekv_4p4d"][0]["num_requests"]}
        for who, results in runs.items():
            if not results[0].get("available", True):
                row[who] = results[0]
                continue
            row[who] = {"wall_s": spread([r["wall_s"] for r in results]),
                        "cpu_s": spread([r["cpu_s"] for r in results]),
                        "cached_ratio": results[0]["cached_ratio"], "mean_ttft_s": results[0]["mean_ttft_s"]}
        if row["dynamo_8_workers"].get("available", True):
            dyn = row["dynamo_8_workers"]["wall_s"]["median"]
            row["speedup_over_dynamo"] = {who: dyn / row[who]["wall_s"]["median"]
                                          for who in ("tidekv_4p4d", "tidekv_8p8d")}
            # On a shared host the CPU seconds wander less than the wall (both run on one core).
            dyn_cpu = row["dynamo_8_workers"]["cpu_s"]["median"]
            row["speedup_over_dynamo_cpu"] = {who: dyn_cpu / row[who]["cpu_s"]["median"]
                                              for who in ("tidekv_4p4d", "tidekv_8p8d")}
        out[name] = row
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssProbe:
    """A record sink passing records on to ``inner`` and noting the process's RSS every
    ``every`` records (the run's memory over its length)."""

    in_index_order = True

    def __init__(self, inner: ReportWriter, every: int):
        self.inner, self.every, self.num, self.samples = inner, every, 0, []
        self.t0 = time.perf_counter()

    def add(self, record: RequestRecord) -> None:
        self.inner.add(record)
        self.num += 1
        if self.num % self.every == 0:
            self.samples.append({"records": self.num, "rss_mib": round(_rss_bytes() / 2**20, 1),
                                 "wall_s": round(time.perf_counter() - self.t0, 1)})
            log(f"big: {self.samples[-1]}")

    def finish(self, *, trace: dict, run: dict) -> Summary:
        return self.inner.finish(trace=trace, run=run)


BIG_WORKERS = 128
BIG_RATE = 16.0  # 16x the workers of the 8+8 runs at 16x the trace's rate: the same load per worker
# Bounded tiers (about 1,440 blocks a worker, ~184k in the cluster: four copies of the trace's
# blocks): the stores are 88% full after 20k requests and full after ~160k, and memory is flat
# from there (docs/architecture.md).
BIG_PREFILL = PrefillConfig(device_bytes=1 << 30, dram_bytes=0, ssd_bytes=0)


def big_run(costs: CostModels, num_requests: int, out_dir: Path) -> dict:
    """``num_requests`` of the tiled synthetic trace on 128+128 workers, records streamed to disk."""
    base = scaled(TRACE, rate=BIG_RATE)
    copies = -(-num_requests // base.num_requests)
    tiled = TiledTrace(base, copies)
    config = SimConfig(BIG_WORKERS, BIG_WORKERS, conductor("mooncake"), BIG_PREFILL, DECODE)
    probe = _RssProbe(ReportWriter(out_dir), every=max(1, tiled.num_requests // 10))
    log(f"big: {tiled.num_requests} requests ({copies} copies) on {BIG_WORKERS}+{BIG_WORKERS}")
    t0, c0, rss0 = time.perf_counter(), time.process_time(), _rss_bytes()
    result = simulate(tiled, config, costs, sink=probe)
    s = result.summary
    return {"num_requests": tiled.num_requests, "copies": copies, "workers": f"{BIG_WORKERS}+{BIG_WORKERS}",
            "rate_scale": BIG_RATE, "device_bytes": BIG_PREFILL.device_bytes,
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "rss_before_mib": round(rss0 / 2**20, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "rss_over_run": probe.samples, "requests_jsonl_bytes": (out_dir / "requests.jsonl").stat().st_size,
            "cached_ratio": s.cache.ratio, "finished": s.counts.finished, "rejected": s.counts.rejected,
            "ttft_p50_s": s.ttft_s.p50, "num_events": result.stats["num_events"]}


def policies(costs: CostModels) -> dict:
    trace = scaled(TRACE, slo=SLO)
    out = {}
    for policy in ("random", "least_loaded", "cache_aware", "kv_cost", "round_robin", "mooncake"):
        log(f"policy {policy}")
        local = policy in ("random", "least_loaded", "cache_aware")  # FAST'25's baselines reuse locally
        cfg = SimConfig(8, 8, conductor(policy, pull_from_peers=not local, admission_mode="none"), PREFILL, DECODE)
        s = simulate(trace, cfg, costs).summary
        out[policy] = {"local_reuse_only": local, "goodput_rps": s.slo.goodput_rps, "attainment": s.slo.attainment,
                       "ttft_mean_s": s.ttft_s.mean, "ttft_p50_s": s.ttft_s.p50, "ttft_p90_s": s.ttft_s.p90,
                       "tbt_p90_s": s.tbt_s.p90, "rejected": s.counts.rejected, "cached_ratio": s.cache.ratio}
    order = ("random", "least_loaded", "cache_aware", "mooncake")
    means = [out[p]["ttft_mean_s"] for p in order]
    out["fig5_order_holds"] = all(a > b for a, b in zip(means, means[1:], strict=False))
    return out


def oscillation(costs_decode_bound: CostModels, plot: str) -> dict:
    trace = scaled(TRACE, rate=3.0, slo={"ttft_slo_s": 30.0, "tbt_slo_s": 0.2})
    out, series = {}, {}
    for mode in ("early", "predictive"):
        log(f"admission {mode}")
        r = simulate(trace, SimConfig(8, 2, conductor("mooncake", admission_mode=mode), PREFILL, DECODE),
                     costs_decode_bound)
        load = r.stats["load"]
        series[mode] = load
        out[mode] = {"rejected": r.summary.counts.rejected, "goodput_rps": r.summary.slo.goodput_rps,
                     "prefill_load_variance": statistics.pvariance([p for _, p, _, _ in load]),
                     "decode_load_variance": statistics.pvariance([d for _, _, d, _ in load])}
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
        for ax, mode in zip(axes, ("early", "predictive"), strict=True):
            t = [x[0] for x in series[mode]]
            ax.plot(t, [x[1] for x in series[mode]], label="prefill jobs held")
            ax.plot(t, [x[2] for x in series[mode]], label="decode requests running")
            ax.set_title(f"{mode} rejection: {out[mode]['rejected']} rejected")
            ax.legend(loc="upper right")
        axes[-1].set_xlabel("simulated time (s)")
        fig.tight_layout()
        fig.savefig(plot)
        out["plot"] = plot
    return out


def sweep_config(flags: dict, **shape) -> SimConfig:
    """A sweep shape's configuration (module level: the sweep's pool processes unpickle it)."""
    policy = shape["policy"] if "policy" in shape else flags["policy"]
    return SimConfig(int(shape["prefill"]), int(shape["decode"]), conductor(policy), PREFILL, DECODE)


def sweep(costs: CostModels) -> dict:
    """The shapes one after another in this process (the baseline), then ``default_jobs()`` at a
    time in a pool, as ``tidekv simulate --sweep`` runs them: both walls, and whether the rows
    agree (they must: a run is deterministic)."""
    trace = scaled(TRACE, slo=SLO)
    grid = {"prefill": ["4", "8"], "decode": ["2", "4", "8"]}
    runs = {}
    for jobs in (1, default_jobs()):
        log(f"sweep: {jobs} at a time")
        t0 = time.perf_counter()
        rows, best = run_sweep(grid, trace, costs, {"policy": "mooncake"}, sweep_config, 0.9, jobs=jobs)
        runs[jobs] = (time.perf_counter() - t0, rows, best)
    (serial_s, rows, best), (pool_s, pool_rows, _) = runs[1], runs[max(runs)]
    same = [{k: v for k, v in r.items() if k != "wall_s"} for r in rows] == [
        {k: v for k, v in r.items() if k != "wall_s"} for r in pool_rows]
    return {"rows": [{"prefill": int(r["prefill"]), "decode": int(r["decode"]), "attainment": r["attainment"],
                      "goodput_rps": r["goodput_rps"]} for r in rows],
            "cheapest_meeting_0.9": best and {"prefill": int(best["prefill"]), "decode": int(best["decode"])},
            "wall_s": {"one_at_a_time": serial_s, f"{max(runs)}_at_a_time": pool_s},
            "speedup": serial_s / pool_s, "same_rows": same}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="only the synthetic trace's speed row and the policies")
    p.add_argument("--repeats", type=int, default=3, help="alternating speed runs of each simulator per trace")
    p.add_argument("--plot", default="", help="write the oscillation plot (PNG) here")
    p.add_argument("--calibration", default="")
    p.add_argument("--big", type=int, default=0, metavar="N",
                   help="also run N tiled requests on 128+128 workers (1000000 for the issue's figure)")
    p.add_argument("--only", choices=("speed", "big", "sweep"), default=None, help="run only this section")
    args = p.parse_args()
    costs = load_models(args.calibration) if args.calibration else CostModels.analytic(**GPU_LIKE)
    decode_bound = CostModels.analytic(**{**GPU_LIKE, "decode_s_per_request": 0.004})
    out: dict = {"costs": "calibration " + args.calibration if args.calibration else {"analytic_gpu_like": GPU_LIKE},
                 "prefill_tiers": {"device_bytes": PREFILL.device_bytes, "dram_bytes": PREFILL.dram_bytes,
                                   "ssd_bytes": PREFILL.ssd_bytes},
                 "slo": SLO, "host": {"cpus": os.cpu_count(), "load_avg_1m_at_start": os.getloadavg()[0]}}
    with tempfile.TemporaryDirectory(prefix="tidekv-bench-sim-") as tmp:
        if args.only in (None, "speed"):
            paths = {"synthetic_3993": TRACE}
            if not args.quick:
                paths["long_prompt_x8_3993"] = long_prompt_trace(Path(tmp) / "long.jsonl")
            out["speed"] = speed(costs, paths, args.repeats)
        if args.only is None:
            out["policies"] = policies(costs)
            if not args.quick:
                out["oscillation"] = oscillation(decode_bound, args.plot)
        if args.only == "sweep" or (args.only is None and not args.quick):
            out["sweep"] = sweep(costs)
        if args.big and args.only in (None, "big"):
            out["big"] = big_run(costs, args.big, Path(tmp) / "big-report")
    out["host"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
