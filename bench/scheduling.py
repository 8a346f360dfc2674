"""The Mooncake scheduler on a live local cluster (2 prefill + 1 decode on 127.0.0.1), with the
other policies as baselines in the same run. Prints one JSON object; progress goes to stderr.

1. Prediction accuracy: a calibration made here, then a few hundred mixed requests (cold and
   sharing prefixes, short and long) through ``mooncake``; |predicted TTFT - observed| /
   observed with the client's TTFT observed, median and p90 (goals: median within 10%, p90
   within 25%), and broken down: by route branch, prompt length and whether a queue was
   predicted, with where the time went against what was predicted for it (the terminal
   message's ``Timing``: the Conductor's queue and TTFT, the worker's prefill, the predicted
   dispatch, queue and prefill), and the error with the Conductor's own TTFT observed. Each
   part's share: the error with the prefill's prediction replaced by the worker's own time
   (``if_prefill_exact``: what the queue and dispatch predictions leave), and with the queue's
   and the dispatch's replaced by what they took (``if_queue_and_dispatch_exact``); and how
   the workers' prefill times stray from their predictions, request to request, and whether
   the previous request's stray foretells the next one's (``prefill_noise``).
2. Policies side by side: the same scaled window of the Mooncake synthetic trace replayed
   live (``replay.live``) against a fresh cluster per policy, at each rate scale given:
   goodput (requests/s meeting both SLOs), TTFT p50/p90, TBT p90, rejection rate,
   cached-token ratio. Goal: ``mooncake``'s goodput at least 1.2x ``cache_aware``'s at the
   rate where ``cache_aware`` starts missing SLOs: the lowest rate given at which its
   attainment is below ``MEETS_SLOS`` (``goal``; when that is the lowest rate given, it may
   start missing below it, and ``goal`` says so).

Usage: python -m bench.scheduling [--quick] [--only prediction|policies] [--rates 1.0,1.5,2.0]
       [--policies mooncake,cache_aware,...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from replay.live import run_live_replay
from replay.traces import SYNTHETIC_TRACE, read_trace
from replay.transform import TraceTransform, apply_transform

ROOT = Path(__file__).resolve().parents[1]
TRACE = SYNTHETIC_TRACE
# The trace's 120-request window with the most reuse inside it (54% of blocks): a replay starts
# with a cold cache, so a window that mostly reuses earlier requests would show no reuse at all.
WINDOW_START = 3840
BLOCK = 16
WORKER_ARGS = ("--block-size", str(BLOCK), "--snapshot-interval-blocks", "4", "--num-pages", "2048")
DECODE_ARGS = ("--block-size", str(BLOCK), "--num-pages", "4096")


def log(msg: str) -> None:
    print(f"[scheduling] {msg}", file=sys.stderr, flush=True)


def calibrate(out: Path, quick: bool) -> None:
    grid = "smoke" if quick else "quick"
    log(f"calibrating ({grid} grid) into {out}")
    subprocess.run([sys.executable, "-m", "deploy.cli", "calibrate", "--model", "tiny", "--grid", grid,
                    "--block-size", str(BLOCK), "--snapshot-interval-blocks", "4", "--out", str(out)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def cluster(policy: str, calibration: Path, extra: tuple[str, ...] = ()) -> LocalCluster:
    return LocalCluster(ClusterConfig(num_prefill=2, num_decode=1, policy=policy, calibration=str(calibration),
                                      prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS,
                                      conductor_args=("--max-running", "64", "--max-queued", "256", *extra)))


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 131 + salt * 7919) % 250 + 1 for i in range(n)]


def prediction_accuracy(calibration: Path, num_requests: int) -> dict:
    """Mixed requests at a few at a time: cold, sharing a prefix with an earlier one, long and short."""
    shared = [prompt(512, 1000 + g) for g in range(4)]
    requests = []
    for i in range(num_requests):
        n = (64, 200, 400, 800)[i % 4]
        ids = shared[i % 4][: n // 2] + prompt(n - n // 2, i) if i % 3 else prompt(n, 5000 + i)
        requests.append(Client.request(ids, max_tokens=4, ttft_slo_s=600.0, tbt_slo_s=60.0))
    log(f"prediction accuracy: {num_requests} requests")
    with cluster("mooncake", calibration) as c:
        client = Client(c.endpoint)
        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(client.generate, requests))
        client.close()
    kept = [(o, n) for o, n in zip(outs, (len(r.token_ids.ids) for r in requests), strict=True)
            if o.ttft_s > 0 and o.predicted_ttft_s]
    by: dict[str, list] = {"all": kept}
    for o, n in kept:
        by.setdefault(f"branch={o.route_branch}", []).append((o, n))
        by.setdefault(f"prompt_tokens={n}", []).append((o, n))
        by.setdefault("queue_predicted" if o.timing.predicted_queue_s > 0 else "no_queue_predicted", []).append((o, n))
    out = error_summary(kept)
    out["prefill_noise"] = prefill_noise([(o.prefill_worker, o.timing.prefill_worker_s, o.timing.predicted_prefill_s)
                                          for o, _ in kept])
    out.update({"goal_median": 0.10, "goal_p90": 0.25, "by_category": {k: error_summary(v, parts=True)
                                                                       for k, v in sorted(by.items())}})
    return out


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))]


def prefill_noise(prefills: list[tuple[str, float, float]]) -> dict | None:
    """How far the workers' prefill times stray from their predictions, and whether the stray
    is foreseeable, from (worker, prefill seconds, predicted seconds) in the order the requests
    were sent: the standard deviation of log(prefill / predicted), and the lag-1
    autocorrelation of that log ratio along each worker's own requests (pooled over workers;
    its square is the share of a stray's variance the previous one foretells). Near 0, one
    request's deviation says nothing of the next one's on that worker, so no pace
    estimate made from recent prefills can follow it, and a prefill prediction without bias
    still misses by about 0.674 x the deviation in the median (``unforeseeable_median_error``,
    relative to the prefill, so less relative to a TTFT that also waited; the median of the
    absolute value of a normal variable). None with under 3 measured prefills."""
    by_worker: dict[str, list[float]] = {}
    for worker, actual_s, predicted_s in prefills:
        if actual_s > 0 and predicted_s > 0:
            by_worker.setdefault(worker, []).append(math.log(actual_s / predicted_s))
    logs = [x for xs in by_worker.values() for x in xs]
    if len(logs) < 3:
        return None
    mean = statistics.fmean(logs)
    variance = statistics.fmean([(x - mean) ** 2 for x in logs])
    pairs = [(a, b) for xs in by_worker.values() for a, b in itertools.pairwise(xs)]
    lag1 = (statistics.fmean([(a - mean) * (b - mean) for a, b in pairs]) / variance
            if pairs and variance > 0 else None)
    sd = math.sqrt(variance)
    return {"num_prefills": len(logs), "log_ratio_mean": round(mean, 4), "log_ratio_sd": round(sd, 4),
            "lag1_autocorrelation": round(lag1, 3) if lag1 is not None else None,
            "unforeseeable_median_error": round(0.6745 * sd, 4)}


def error_summary(kept: list, parts: bool = False) -> dict:
    """Relative errors of a set of completions, against the client's TTFT and the Conductor's
    (arrival to first token); with ``parts``, medians (ms) of where the time went: the client's
    hop (client TTFT - Conductor TTFT), the Conductor until the prefill call, the worker's
    prefill, the rest of the Conductor's TTFT (the worker's queue, the RPCs), against the
    predicted dispatch, queue and prefill."""
    client = [abs(o.predicted_ttft_s - o.ttft_s) / o.ttft_s for o, _ in kept]
    server = [abs(o.predicted_ttft_s - o.timing.ttft_s) / o.timing.ttft_s for o, _ in kept if o.timing.ttft_s > 0]
    signed = [(o.predicted_ttft_s - o.ttft_s) / o.ttft_s for o, _ in kept]
    # Each part's share: the error with the other part replaced by what happened. With the
    # prefill exact, what is left is the queue's and the dispatch's; with the queue and the
    # dispatch exact, the prefill's (the worker's own time against its prediction).
    prefill_exact = [abs(o.predicted_ttft_s - o.timing.predicted_prefill_s + o.timing.prefill_worker_s - o.ttft_s)
                     / o.ttft_s for o, _ in kept]
    queue_exact = [abs(o.timing.predicted_prefill_s - o.timing.prefill_worker_s) / o.ttft_s for o, _ in kept]
    out = {"num_requests": len(client), "median_rel_error": statistics.median(client), "p90_rel_error": _q(client, 0.9),
           "median_signed_error": statistics.median(signed),
           "vs_conductor_ttft": {"median_rel_error": statistics.median(server), "p90_rel_error": _q(server, 0.9)},
           "if_prefill_exact": {"median_rel_error": statistics.median(prefill_exact),
                                "p90_rel_error": _q(prefill_exact, 0.9)},
           "if_queue_and_dispatch_exact": {"median_rel_error": statistics.median(queue_exact),
                                           "p90_rel_error": _q(queue_exact, 0.9)}}
    if parts:
        def ms(f) -> float:
            return round(1e3 * statistics.median(f(o.timing, o) for o, _ in kept), 2)
        out["median_ms"] = {
            "client_ttft": ms(lambda t, o: o.ttft_s), "predicted_ttft": ms(lambda t, o: t.predicted_ttft_s),
            "client_hop": ms(lambda t, o: o.ttft_s - t.ttft_s), "conductor_to_prefill_call": ms(lambda t, o: t.queue_s),
            "worker_prefill": ms(lambda t, o: t.prefill_worker_s),
            "worker_queue_and_rpcs": ms(lambda t, o: t.ttft_s - t.queue_s - t.prefill_worker_s),
            "predicted_dispatch": ms(lambda t, o: t.predicted_dispatch_s),
            "predicted_queue": ms(lambda t, o: t.predicted_queue_s),
            "predicted_prefill": ms(lambda t, o: t.predicted_prefill_s),
            "slowdown": ms(lambda t, o: t.predicted_slowdown) / 1e3}
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def window(rate: float, num_requests: int, ttft_slo_s: float, tbt_slo_s: float):
    t = TraceTransform(block_size=BLOCK, blocks_per_trace_block=1, output_scale=0.1, max_output_tokens=32,
                       rate_scale=rate, index_start=WINDOW_START, index_end=WINDOW_START + num_requests,
                       ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s)
    return apply_transform(read_trace(TRACE), t)


MEETS_SLOS = 0.9  # a policy whose attainment (share of requests meeting both SLOs) is below this misses them


def compare_policies(policies: list[str], rates: list[float], calibration: Path, num_requests: int,
                     ttft_slo_s: float, tbt_slo_s: float, out_dir: Path) -> dict:
    results: dict = {}
    for rate in rates:
        scaled = window(rate, num_requests, ttft_slo_s, tbt_slo_s)
        for policy in policies:
            log(f"policy {policy} at rate x{rate}: {len(scaled.requests)} requests")
            with cluster(policy, calibration) as c:
                time.sleep(1.0)  # first heartbeats
                live = run_live_replay(scaled, c.endpoint, max_concurrency=64, out_dir=out_dir / f"{policy}-{rate}",
                                       plots=False, progress=False)
            s = live.summary
            results.setdefault(str(rate), {})[policy] = {
                "goodput_rps": s.slo.goodput_rps, "attainment": s.slo.attainment, "ttft_p50_s": s.ttft_s.p50,
                "ttft_p90_s": s.ttft_s.p90, "tbt_p90_s": s.tbt_s.p90,
                "rejection_rate": s.counts.rejected / s.counts.total, "failed": s.counts.failed,
                "cached_ratio": s.cache.ratio}
    for by in results.values():
        if "mooncake" in by and "cache_aware" in by and by["cache_aware"]["goodput_rps"] > 0:
            by["mooncake_over_cache_aware_goodput"] = by["mooncake"]["goodput_rps"] / by["cache_aware"]["goodput_rps"]
    missing = [rate for rate in rates if (ca := results[str(rate)].get("cache_aware")) is not None
               and ca["attainment"] is not None and ca["attainment"] < MEETS_SLOS]
    if missing:
        at = str(min(missing))
        results["goal"] = {"rate_where_cache_aware_starts_missing": float(at), "cache_aware_meets_slos_at": MEETS_SLOS,
                           "mooncake_over_cache_aware_goodput": results[at].get("mooncake_over_cache_aware_goodput"),
                           "misses_at_the_lowest_rate_given": float(at) == min(rates), "goal": 1.2}
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=("prediction", "policies"), help="run one of the two measurements")
    p.add_argument("--rates", default="1.0,1.5,2.0")
    p.add_argument("--policies", default="mooncake,cache_aware,kv_cost,round_robin")
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--tbt-slo-s", type=float, default=0.1)
    args = p.parse_args()
    n_pred, n_window = (40, 40) if args.quick else (240, 120)
    with tempfile.TemporaryDirectory(prefix="tidekv-bench-sched-") as tmp:
        calibration = Path(tmp) / "calibration.json"
        calibrate(calibration, args.quick)
        out = {}
        if args.only != "policies":
            out["prediction"] = prediction_accuracy(calibration, n_pred)
        if args.only != "prediction":
            out["policies"] = compare_policies(args.policies.split(","), [float(r) for r in args.rates.split(",")],
                                               calibration, n_window, args.ttft_slo_s, args.tbt_slo_s, Path(tmp))
        out |= {"workload": {"window": f"requests {WINDOW_START}..{WINDOW_START + n_window} of {TRACE.name}",
                            "block_size": BLOCK, "ttft_slo_s": args.ttft_slo_s, "tbt_slo_s": args.tbt_slo_s,
                            "cluster": "2 prefill + 1 decode"}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
