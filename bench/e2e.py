"""End-to-end benchmark of a local cluster (Conductor + 1 prefill + 1 decode on 127.0.0.1).

Measures side by side in one run and prints one JSON object (progress goes to stderr):

0. the first request's TTFT on the fresh cluster (workers warm up before they register) vs the
   steady-state cold TTFT of the same length (the median of measurement 1's cold requests);
1. TTFT of a 2,048-token prompt cold vs with its first 1,792 tokens cached (the cold request
   is also the primer: the cached one shares its prefix and differs after it; the prefix stays
   in the prefill worker's device tier and is reused in place), beside the single-process
   prefill of only the new tokens over the cached prefix, the compute no cache removes;
2. cluster TTFT (cold) vs the single-process engine prefill of the same prompt here, measured
   just before and just after it (their ratio is the engine's own run-to-run spread), with a
   timeline of every cold and cached request (``Timeline``: the Conductor's queue and
   server-side TTFT, the prefill worker's seconds per stage, the KV transfer, and the CPU
   seconds of every process meanwhile);
3. inter-token latency of one decode stream, idle and while another client floods 1,500-token
   cold prefills, for the cluster and for a colocated engine in this process.

Every repeat uses fresh prompts, so nothing is cached across repeats. The cluster is always
stopped (context manager). Usage: python -m bench.e2e [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time

import grpc
import torch

import engine
from bench.common import process_cpu_s, summary
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from observe.top import scrape

BLOCK_SIZE = 32
SNAPSHOT_INTERVAL_BLOCKS = 8  # 1792 / 32 = 56 blocks, a snapshot point
PROMPT_LEN, CACHED_LEN, FLOOD_LEN, STREAM_PROMPT_LEN = 2048, 1792, 1500, 256
SETTLE_S = 0.5  # before each timed request: the prefill worker stores blocks after answering
GOALS = {"cached_over_cold": 0.08, "cluster_over_single_process": 1.1, "cluster_over_single_process_every": 1.15,
         "disagg_p99_flood_over_idle": 1.3, "first_over_steady": 1.2}


def log(msg: str) -> None:
    print(f"[e2e] {msg}", file=sys.stderr, flush=True)


def ids(seed: int, n: int) -> list[int]:
    """n byte-range token ids (below the tiny model's special ids), fixed by seed."""
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile, q in (0, 1]."""
    s = sorted(samples)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b > 0 else float("nan")


# ---- single process ---------------------------------------------------------------------------
def local_prefill_s(model, prompt: list[int], cached: int = 0) -> float:
    """Engine prefill only (cache set-up excluded), in this process; with ``cached``, of the
    tokens after the first ``cached``, which are prefilled first, untimed (the compute a
    cached prefill cannot avoid)."""
    cache = model.new_cache(len(prompt) // BLOCK_SIZE + 1, 1, BLOCK_SIZE)
    seq = cache.try_reserve("local", len(prompt))
    if cached:
        model.prefill(cache, seq, prompt[:cached])
    t0 = time.perf_counter()
    model.prefill(cache, seq, prompt[cached:])
    return time.perf_counter() - t0


def colocated_gaps(model, prompt: list[int], max_tokens: int, flood_seed: int | None, cap_s: float) -> list[float]:
    """One engine serving the stream and the flood: before every decode step it runs a pending
    flood prefill in full. A closed-loop flood client with no think time always has its next
    prompt pending, so with a flood every step waits for one 1,500-token prefill."""
    num_pages = (len(prompt) + max_tokens + FLOOD_LEN) // BLOCK_SIZE + 4  # the stream + one flood prompt
    cache = model.new_cache(num_pages, 2, BLOCK_SIZE)
    seq = cache.try_reserve("stream", len(prompt) + max_tokens)
    tok = int(model.prefill(cache, seq, prompt).argmax())
    stamps, until = [], time.perf_counter() + cap_s
    for i in range(max_tokens - 1):
        if flood_seed is not None:
            fseq = cache.try_reserve(f"flood-{i}", FLOOD_LEN)
            model.prefill(cache, fseq, ids(flood_seed + i, FLOOD_LEN)).argmax()
            cache.release(fseq)
        tok = int(model.decode_step(cache, [seq], [tok])[0].argmax())
        stamps.append(time.perf_counter())
        if stamps[-1] > until:
            break
    cache.release(seq)
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


# ---- cluster ----------------------------------------------------------------------------------
def ttft(client: Client, prompt: list[int]) -> tuple[float, int]:
    """Client-measured TTFT and the cached_tokens the cluster reports; raises on a failed request."""
    out = client.generate(Client.request(prompt, max_tokens=1))
    if out.finish_reason not in ("length", "stop"):
        raise RuntimeError(f"request failed ({out.finish_reason}): {out.error}")
    return out.ttft_s, out.cached_tokens


def cluster_gaps(endpoint: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Gaps between streamed token messages, from the second message (the first decode token) on:
    the first gap also holds the KV hand-off, which is TTFT's business, not ITL's."""
    client, stamps = Client(endpoint), []
    try:
        for msg in client.stub.Generate(Client.request(prompt, max_tokens=max_tokens), timeout=600):
            if msg.token_ids:
                stamps.append(time.perf_counter())
            if msg.error:
                raise RuntimeError(f"stream failed: {msg.error}")
    finally:
        client.close()
    return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]


class Flood:
    """A client thread sending fresh FLOOD_LEN-token prompts (max_tokens=1) back to back until stopped."""

    def __init__(self, endpoint: str, seed: int):
        self.client, self.seed = Client(endpoint), seed
        self.num_done = self.num_refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                self.client.generate(Client.request(ids(self.seed + i, FLOOD_LEN), max_tokens=1))
                self.num_done += 1
            except grpc.RpcError:  # refused (admission): counted; the flood goes on
                self.num_refused += 1
                self._stop.wait(0.2)

    def __enter__(self) -> Flood:
        self._thread.start()
        time.sleep(0.5)  # let the first flood prefill start before the stream does
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        self.client.close()


# ---- where a TTFT goes ------------------------------------------------------------------------
def _sums(address: str) -> dict[str, float]:
    """The _sum of each timeline histogram of one /metrics endpoint, by name[stage or direction]."""
    out: dict[str, float] = {}
    for name, labels, value in scrape(address):
        if name.endswith("_sum") and name.startswith(TIMELINE_SUMS):
            label = dict(labels).get("stage") or dict(labels).get("direction")
            key = name.removeprefix("tidekv:").removesuffix("_sum") + (f"[{label}]" if label else "")
            out[key] = out.get(key, 0.0) + value
    return out


TIMELINE_SUMS = ("tidekv:request_queue_time_seconds", "tidekv:time_to_first_token_seconds",
                 "tidekv:prefill_seconds", "tidekv:prefill_stage_seconds", "tidekv:transfer_seconds")


class Timeline:
    """One request's timeline, from the differences of the cluster's own counters around it
    (requests run one at a time): the Conductor's queue and server-side TTFT, the prefill
    worker's seconds per stage (queue, reuse, compute, push, verdict, store) and the KV
    transfer's first frame to verdict, and the CPU seconds each process used meanwhile (CPU
    contention: the prefill process got less CPU than the wall time it took)."""

    def __init__(self, cluster: LocalCluster):
        self.addresses = cluster.metrics_addresses()
        self.pids = {name: p.pid for name, p in cluster.procs.items()} | {"bench": os.getpid()}

    def around(self, fn):
        before, cpu0, t0 = self._sample(), self._cpu(), time.perf_counter()
        result = fn()
        wall = time.perf_counter() - t0
        after, cpu1 = self._sample(), self._cpu()
        diff = {k: round(after.get(k, 0.0) - before.get(k, 0.0), 4) for k in after}
        cpu = {name: round(cpu1[name] - cpu0[name], 3) for name in cpu1}
        prefill = diff.get("prefill_seconds", 0.0)
        stages = {k.split("[")[1][:-1]: v for k, v in diff.items() if k.startswith("prefill_stage_seconds[")}
        ttft_server = diff.get("time_to_first_token_seconds", 0.0)
        prefill_cpu = sum(v for name, v in cpu.items() if name.startswith("prefill"))
        return result, {
            "wall_s": round(wall, 4), "server_ttft_s": ttft_server,
            "conductor_queue_s": diff.get("request_queue_time_seconds", 0.0),
            "prefill_s": prefill, "prefill_stages_s": stages,
            "transfer_first_frame_to_verdict_s": diff.get("transfer_seconds[send]", 0.0),
            "conductor_and_rpc_s": round(ttft_server - prefill, 4),
            "cpu_s": cpu, "prefill_cpu_over_prefill_wall": ratio(prefill_cpu, prefill),
        }

    def _sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for address in self.addresses:
            for k, v in _sums(address).items():
                out[k] = out.get(k, 0.0) + v
        return out

    def _cpu(self) -> dict[str, float]:
        return {name: process_cpu_s(pid) for name, pid in self.pids.items()}


# ---- the three measurements -------------------------------------------------------------------
def measure_ttft(model, client: Client, timeline: Timeline, repeats: int) -> dict:
    """Per repeat, in this order: the single-process prefill of the cold prompt (``before``),
    the cold and the cached request on the cluster, the single-process prefill again
    (``after``), and the single-process prefill of the cached prompt's 256 new tokens over its
    cached prefix (the compute floor of a cached TTFT). A repeat's cluster ratio is to the mean
    of its ``before`` and ``after``, which bracket it in time; ``before / after`` is the
    engine's own run-to-run spread on this host (the same prompt, nothing else running), the
    resolution any per-repeat ratio here has."""
    cold, cached, before, after, floor, cached_tokens, lines = [], [], [], [], [], [], []
    for r in range(repeats):
        prefix = ids(1000 + r, CACHED_LEN)
        cold_prompt = prefix + ids(2000 + r, PROMPT_LEN - CACHED_LEN)
        t_before = local_prefill_s(model, cold_prompt)
        time.sleep(SETTLE_S)
        (t_cold, _), cold_line = timeline.around(lambda p=cold_prompt: ttft(client, p))  # also the primer
        time.sleep(SETTLE_S)
        cached_prompt = prefix + ids(3000 + r, PROMPT_LEN - CACHED_LEN)
        (t_cached, n), cached_line = timeline.around(lambda p=cached_prompt: ttft(client, p))
        time.sleep(SETTLE_S)
        t_after = local_prefill_s(model, cold_prompt)
        t_floor = local_prefill_s(model, cached_prompt, cached=CACHED_LEN)
        for samples, x in ((cold, t_cold), (cached, t_cached), (before, t_before), (after, t_after),
                           (floor, t_floor), (cached_tokens, n)):
            samples.append(x)
        lines.append({"repeat": r, "cold": cold_line, "cached": cached_line,
                      "single_process_prefill_s": {"before": t_before, "after": t_after},
                      "single_process_new_tokens_prefill_s": t_floor})
        st = cold_line["prefill_stages_s"]
        log(f"ttft repeat {r}: cold {t_cold:.2f}s cached {t_cached:.2f}s ({n} tokens) local prefill "
            f"{t_before:.2f}s / {t_after:.2f}s, new tokens only {t_floor:.3f}s; cold: compute "
            f"{st.get('compute', 0):.2f}s push {st.get('push', 0):.3f}s verdict {st.get('verdict', 0):.3f}s "
            f"store {st.get('store', 0):.3f}s conductor+rpc {cold_line['conductor_and_rpc_s']:.3f}s")
    local = before + after
    c, w, lo, fl = summary(cold), summary(cached), summary(local), summary(floor)
    per_repeat = [ratio(x, (b + a) / 2) for x, b, a in zip(cold, before, after, strict=True)]
    return {
        "prefix_cache": {
            "prompt_tokens": PROMPT_LEN, "prefix_tokens": CACHED_LEN, "cold": c, "cached": w,
            "cached_tokens_reported": cached_tokens, "ratio_cached_over_cold": ratio(w["median_s"], c["median_s"]),
            "ratios_per_repeat": [ratio(a, b) for a, b in zip(cached, cold, strict=True)],
            "goal": GOALS["cached_over_cold"], "meets_goal": w["median_s"] / c["median_s"] <= GOALS["cached_over_cold"],
            # What no cache can remove: the engine computing the new tokens over the cached prefix.
            "single_process_new_tokens_prefill": fl,
            "floor_new_tokens_over_single_process_cold": ratio(fl["median_s"], lo["median_s"]),
        },
        "cluster_vs_single_process": {
            "cluster_ttft_cold": c, "single_process_prefill": lo,
            "ratio_cluster_over_single_process": ratio(c["median_s"], lo["median_s"]),
            "ratios_per_repeat": per_repeat,
            "single_process_before_over_after_per_repeat": [ratio(b, a) for b, a in zip(before, after, strict=True)],
            "goal": GOALS["cluster_over_single_process"],
            "goal_every_repeat": GOALS["cluster_over_single_process_every"],
            "meets_goal": (c["median_s"] / lo["median_s"] <= GOALS["cluster_over_single_process"]
                           and max(per_repeat) <= GOALS["cluster_over_single_process_every"]),
        },
        "timelines": lines,
    }


def itl_stats(runs: list[list[float]]) -> dict:
    pooled = [g for run in runs for g in run]
    if not pooled:
        return {"n_gaps": 0}
    return {"p50_ms": round(pct(pooled, 0.5) * 1e3, 2), "p99_ms": round(pct(pooled, 0.99) * 1e3, 2),
            "max_ms": round(max(pooled) * 1e3, 2), "n_gaps": len(pooled),
            "p99_ms_per_run": [round(pct(r, 0.99) * 1e3, 2) for r in runs if r]}


def with_ratio(idle: list[list[float]], flood: list[list[float]]) -> dict:
    i, f = itl_stats(idle), itl_stats(flood)
    return {"idle": i, "flood": f, "p99_flood_over_idle": ratio(f.get("p99_ms", 0), i.get("p99_ms", 0))}


def measure_itl(model, endpoint: str, runs: int, max_tokens: int, colocated_cap_s: float) -> dict:
    gaps: dict[str, list[list[float]]] = {k: [] for k in ("d_idle", "d_flood", "c_idle", "c_flood")}
    floods = []
    for r in range(runs):
        base = 20_000 + 100 * r
        gaps["d_idle"].append(cluster_gaps(endpoint, ids(base + 1, STREAM_PROMPT_LEN), max_tokens))
        with Flood(endpoint, seed=100_000 + 1000 * r) as flood:
            gaps["d_flood"].append(cluster_gaps(endpoint, ids(base + 2, STREAM_PROMPT_LEN), max_tokens))
        floods.append({"completed": flood.num_done, "refused": flood.num_refused})
        time.sleep(SETTLE_S)
        gaps["c_idle"].append(colocated_gaps(model, ids(base + 3, STREAM_PROMPT_LEN), max_tokens, None, 600))
        gaps["c_flood"].append(colocated_gaps(model, ids(base + 4, STREAM_PROMPT_LEN), max_tokens,
                                              200_000 + 1000 * r, colocated_cap_s))
        log(f"itl run {r}: " + ", ".join(f"{k} p99 {pct(v[-1], 0.99) * 1e3:.0f}ms" for k, v in gaps.items() if v[-1]))
    d, c = with_ratio(gaps["d_idle"], gaps["d_flood"]), with_ratio(gaps["c_idle"], gaps["c_flood"])
    return {
        "stream_prompt_tokens": STREAM_PROMPT_LEN, "stream_max_tokens": max_tokens, "flood_prompt_tokens": FLOOD_LEN,
        "disaggregated": {**d, "goal": GOALS["disagg_p99_flood_over_idle"],
                          "meets_goal": d["p99_flood_over_idle"] <= GOALS["disagg_p99_flood_over_idle"],
                          "flood_requests": floods},
        "colocated": {**c, "stream_capped_at_s": colocated_cap_s},
        "flood_p99_colocated_over_disaggregated": ratio(c["flood"].get("p99_ms", 0), d["flood"].get("p99_ms", 0)),
    }


def warm_up(model, client: Client) -> None:
    """First requests pay one-off costs (connections, allocator, lazy imports)."""
    for seed in (1, 2):
        ttft(client, ids(seed, STREAM_PROMPT_LEN))
    local_prefill_s(model, ids(3, STREAM_PROMPT_LEN))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="about a minute: fewer repeats, a shorter stream")
    args = ap.parse_args()
    repeats, runs, max_tokens, cap_s = (2, 1, 60, 6.0) if args.quick else (5, 2, 200, 20.0)
    torch.set_num_threads(1)  # the same as each worker process (TIDEKV_TORCH_THREADS=1)
    model = engine.load_model("tiny")
    t0, load_start = time.perf_counter(), os.getloadavg()
    cfg = ClusterConfig(num_prefill=1, num_decode=1, threads_per_process=1,
                        prefill_args=("--block-size", str(BLOCK_SIZE),
                                      "--snapshot-interval-blocks", str(SNAPSHOT_INTERVAL_BLOCKS)),
                        decode_args=("--block-size", str(BLOCK_SIZE)))
    log("starting the cluster")
    with LocalCluster(cfg) as cluster, torch.inference_mode():
        client = Client(cluster.endpoint)
        try:
            first_s, _ = ttft(client, ids(999, PROMPT_LEN))  # nothing has run on the cluster before
            log(f"first request on the fresh cluster: TTFT {first_s:.2f}s")
            warm_up(model, client)
            ttft_result = measure_ttft(model, client, Timeline(cluster), repeats)
            steady = ttft_result["prefix_cache"]["cold"]["median_s"]
            ttft_result["first_request"] = {
                "first_s": round(first_s, 4), "steady_cold_median_s": steady,
                "ratio_first_over_steady": ratio(first_s, steady), "goal": GOALS["first_over_steady"],
                "meets_goal": first_s / steady <= GOALS["first_over_steady"]}
        finally:
            client.close()
        itl = measure_itl(model, cluster.endpoint, runs, max_tokens, cap_s)
    result = {
        "quick": args.quick, "cpu_count": os.cpu_count(), "torch_threads_per_process": 1,
        "loadavg_1m_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        "block_size": BLOCK_SIZE, "snapshot_interval_blocks": SNAPSHOT_INTERVAL_BLOCKS, "repeats": repeats,
        "ttft": ttft_result, "itl": itl, "wall_s": round(time.perf_counter() - t0, 1),
        "notes": (f"{os.cpu_count()} cores shared by the Conductor, the prefill and decode workers and this "
                  "process (plus whatever else runs on the machine, see loadavg): during a flood the prefill "
                  "and decode processes compete for CPU, which inflates the disaggregated under-flood ITL. "
                  "Colocated flood: every decode step waits for one full flood prefill (closed-loop client), "
                  "so its stream is capped in time and has few gaps."),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
