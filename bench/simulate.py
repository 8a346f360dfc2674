"""The simulator at scale, with NVIDIA Dynamo's offline replay as the baseline in the same run.
Prints one JSON object; progress goes to stderr; writes the oscillation plot next to it.

1. Speed and cache: the Mooncake synthetic trace (3,993 requests) and a 12,000-request trace of
   the same shape (three copies, later ones shifted in time with their own hash ids), at the
   trace's rate: wall time of ``simulate`` and its cached-token ratio, for 4+4 and 8+8
   workers, next to ``dynamo.replay.api.run_trace_replay(num_workers=8, router_mode=
   "kv_router")`` on the same file (``ai-dynamo==1.6.1`` + ``ai-dynamo-runtime==1.6.1``
   installed with ``pip install --no-deps``; reported as unavailable otherwise).
2. Policies on the synthetic trace (8 prefill + 8 decode): goodput, TTFT mean/p50/p90, TBT p90,
   rejections, cached-token ratio; FAST'25 Fig. 5's ordering of mean TTFT.
3. Plain vs prediction-based early rejection (decode-bound: 8 + 2 workers at 3x the rate):
   rejections, goodput, variance of the prefill and decode load series, and a PNG of both
   series (``--plot``).
4. A sweep (prefill 4/8, decode 2/4/8, mooncake): the cheapest shape meeting the SLOs.

The tiny CPU model cannot serve this trace at its rate, so these runs use an analytic cost
model of a GPU-class instance (10k prefill tokens/s, 20 ms + 0.5 ms per request decode step;
stated in the output); ``--calibration FILE`` uses a measured one instead.

Usage: python -m bench.simulate [--quick] [--plot oscillation.png] [--calibration FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from conductor.config import ConductorConfig
from costmodel import CostModels, load_models
from decode_worker.config import DecodeConfig
from prefill_worker.config import PrefillConfig
from replay.sim.run import SimConfig, simulate
from replay.traces import SYNTHETIC_TRACE, read_trace
from replay.transform import TraceTransform, apply_transform

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


def tiled_trace(out: Path, copies: int = 3) -> Path:
    """``copies`` back-to-back copies of the synthetic trace; copy i shifts arrivals by i times
    the trace's span and its hash ids past every id before it (so copies share nothing)."""
    trace = read_trace(TRACE)
    span = max(r.arrival_s for r in trace.requests) + 1.0
    offset = max(h for r in trace.requests for h in r.hash_ids) + 1
    rows = []
    for i in range(copies):
        rows += [dataclasses.replace(r, index=i * len(trace.requests) + r.index, arrival_s=r.arrival_s + i * span,
                                     hash_ids=tuple(h + i * offset for h in r.hash_ids)) for r in trace.requests]
    with out.open("w") as f:
        for r in rows:
            f.write(json.dumps({"timestamp": r.arrival_s * 1000.0, "input_length": r.input_len,
                                "output_length": r.output_len, "hash_ids": list(r.hash_ids)}) + "\n")
    return out


def dynamo_replay(path: Path) -> dict:
    os.environ.setdefault("RUST_LOG", "error")
    os.environ.setdefault("DYN_LOG", "error")
    try:
        from dynamo.replay.api import run_trace_replay
    except ImportError as e:
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}
    t0 = time.perf_counter()
    report = run_trace_replay([str(path)], num_workers=8, router_mode="kv_router", arrival_speedup_ratio=1.0,
                              trace_block_size=512)
    wall = time.perf_counter() - t0
    s = report.to_dict()["summary"] if hasattr(report, "to_dict") else report["summary"]
    return {"available": True, "wall_s": wall, "runtime_wall_s": s["wall_time_ms"] / 1e3,
            "cached_ratio": s["prefix_cache_reused_ratio"], "mean_ttft_s": s["mean_ttft_ms"] / 1e3,
            "num_requests": s["num_requests"]}


def speed(costs: CostModels, paths: dict[str, Path]) -> dict:
    out = {}
    for name, path in paths.items():
        trace = scaled(path)
        row = {"num_requests": len(trace.requests), "dynamo_8_workers": dynamo_replay(path)}
        for num in (4, 8):
            log(f"speed: {name} on {num}+{num}")
            result = simulate(trace, SimConfig(num, num, conductor("mooncake"), PREFILL, DECODE), costs)
            row[f"tidekv_{num}p{num}d"] = {"wall_s": result.stats["wall_s"], "cached_ratio": result.summary.cache.ratio,
                                         "mean_ttft_s": result.summary.ttft_s.mean}
        dyn = row["dynamo_8_workers"]
        if dyn.get("available"):
            row["wall_ratio_tidekv_4p4d_over_dynamo"] = row["tidekv_4p4d"]["wall_s"] / dyn["wall_s"]
        out[name] = row
    return out


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


def sweep(costs: CostModels) -> dict:
    trace = scaled(TRACE, slo=SLO)
    rows = []
    for p in (4, 8):
        for d in (2, 4, 8):
            log(f"sweep {p}+{d}")
            s = simulate(trace, SimConfig(p, d, conductor("mooncake"), PREFILL, DECODE), costs).summary
            rows.append({"prefill": p, "decode": d, "attainment": s.slo.attainment, "goodput_rps": s.slo.goodput_rps})
    meeting = [r for r in rows if r["attainment"] >= 0.9]
    return {"rows": rows, "cheapest_meeting_0.9": min(meeting, key=lambda r: r["prefill"] + r["decode"], default=None)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="only the synthetic trace's speed row and the policies")
    p.add_argument("--plot", default="", help="write the oscillation plot (PNG) here")
    p.add_argument("--calibration", default="")
    args = p.parse_args()
    costs = load_models(args.calibration) if args.calibration else CostModels.analytic(**GPU_LIKE)
    decode_bound = CostModels.analytic(**{**GPU_LIKE, "decode_s_per_request": 0.004})
    with tempfile.TemporaryDirectory(prefix="tidekv-bench-sim-") as tmp:
        paths = {"synthetic_3993": TRACE}
        if not args.quick:
            paths["tiled_11979"] = tiled_trace(Path(tmp) / "tiled.jsonl")
        out = {"costs": "calibration " + args.calibration if args.calibration else {"analytic_gpu_like": GPU_LIKE},
               "prefill_tiers": {"device_bytes": PREFILL.device_bytes, "dram_bytes": PREFILL.dram_bytes,
                                 "ssd_bytes": PREFILL.ssd_bytes},
               "slo": SLO, "speed": speed(costs, paths), "policies": policies(costs)}
        if not args.quick:
            out["oscillation"] = oscillation(decode_bound, args.plot)
            out["sweep"] = sweep(costs)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
