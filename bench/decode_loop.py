"""What the decode worker's loop and the Conductor's stream add on top of the engine's decode step.

Prints JSON with two parts.

``loop``, for each batch size B (1, 8, 32): time per step of three arms in one process, run
round by round in a rotating order, so a burst of load from other processes lands on each alike:

- ``bare``: a loop calling ``model.decode_step`` and ``engine.sample`` on B sequences that
  start at ``--context`` tokens, the least any decode loop must do;
- ``loop``: the real ``DecodeScheduler`` loop with B requests of the same length decoding,
  their output queues read after the round;
- ``loop_rpc``: the same, with each request's tokens drained while it decodes by its own
  thread through ``DecodeService.Decode`` (the gRPC handler as the worker runs it, minus the
  transport), so the handlers' wake-ups and GIL share count too.

A loop step is the interval between two consecutive full-batch steps, stamped by the
scheduler's metrics hook: admission, the model step, sampling and handing the tokens over.
``in_loop_model`` is the hook's own figure for the model step and sampling of the same
iterations, and ``overhead_us`` the median over steps of (interval - in-loop model): the
loop's own work, measured inside each iteration so that it does not drown in the noise of
two separately timed medians. ``ratio`` is median(loop) / median(bare) (the issue's goal:
at most 1.1x at batch 8 and 32) with its per-round values; on a shared host its rounds scatter
by +-10% or more, so ``ratio_to_own_model_step`` gives the median over steps of interval /
in-loop model step, the same question asked inside each iteration. ``overhead_us`` also
counts freeing the step's tensors, which the bare arm pays inside its timed call.

``throughput_over_batch_1``: the loop's tokens per second at batch B over batch 1 (the
issue's goal: at least 6x at batch 32).

``loop_null_model``: the same two loop arms over a model whose decode step does nothing
(200 steps a round), so ``*_overhead_us`` is the loop's own work per step, free of the
model step's noise.

``conductor``: the per-token cost of forwarding a stream, two ways:

- ``in_process``: the Conductor's per-token path (parse the worker's ``DecodeResponse``,
  ``ClientStream.more``: intervals, metrics, text delta, and the client's
  ``GenerateResponse`` serialised), timed per token at several stream positions, since the
  text delta re-decodes every token sent so far (``conductor/client_stream.py``);
- ``cluster``: a ``LocalCluster`` 1x1 streaming one long request. The client stamps every
  message; the decode worker's step histogram (``tidekv:decode_step_seconds``) gives its mean
  model step over the request, compared with the client's mean gap (mean to mean: the
  histogram has no median); the Conductor's and the decode worker's CPU time
  (``/proc/<pid>/stat``) read at every ``--cpu-every`` tokens give their CPU per token along
  the stream (less what it burns idle, measured for ``idle_s`` before the request). A client
  gap minus the worker's step is what the loop, two gRPC hops and the Conductor add; the
  Conductor's CPU per token is its share, free of the wall-clock noise (10 ms CPU ticks over
  some 500 tokens of ~10 ms: about 2% resolution).

Usage: python -m bench.decode_loop [--quick] [--threads N] [--skip-cluster]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
import urllib.request

import torch
from prometheus_client import CollectorRegistry

import engine
from bench.common import process_cpu_s, summary
from decode_worker.metrics import DecodeMetrics
from decode_worker.scheduler import DecodeScheduler, Finished
from decode_worker.server import DecodeService
from engine import SamplingParams, sample
from proto import internal_pb2 as ipb
from runtime.metrics import Identity

BLOCK = 16


class StepStamps(DecodeMetrics):
    """The worker's real metrics, plus (when it ended, batch size, model step s) for every step."""

    def __init__(self) -> None:
        super().__init__(Identity("bench", "decode", "tiny"), CollectorRegistry())
        self.rows: list[tuple[float, int, float]] = []

    def step(self, batch_size: int, step_s: float) -> None:
        self.rows.append((time.perf_counter(), batch_size, step_s))
        super().step(batch_size, step_s)


class _KvReady:
    """The receiver as ``Decode`` sees it: every request's KV has arrived."""

    def wait_complete(self, request_id: str, timeout_s: float) -> None:
        return None


class _Call:
    """The gRPC context ``Decode`` uses: a client that stays."""

    def add_callback(self, fn) -> bool:
        return True

    def is_active(self) -> bool:
        return True

    def abort(self, code, details: str):
        raise RuntimeError(f"{code}: {details}")


def _full_batch_steps(rows: list[tuple[float, int, float]], batch: int) -> tuple[list[float], list[float]]:
    """(loop intervals, in-loop model steps) of the iterations that follow a full-batch step
    and are one themselves."""
    intervals, models = [], []
    for (t0, b0, _), (t1, b1, m1) in zip(rows, rows[1:], strict=False):
        if b0 == b1 == batch:
            intervals.append(t1 - t0)
            models.append(m1)
    return intervals, models


def _loop_round(sched: DecodeScheduler, stamps: StepStamps, batch: int, ctx: int, steps: int, rpc: bool,
                tag: str) -> tuple[list[float], list[float]]:
    stamps.rows.clear()
    params = SamplingParams(max_new_tokens=steps + 1)
    rids = [f"{tag}-{i}" for i in range(batch)]
    for rid in rids:
        assert sched.try_reserve(rid, ctx + steps + 1) is not None
    if rpc:
        service = DecodeService(sched, _KvReady(), 60.0)
        counts = [0] * batch
        go = threading.Barrier(batch)  # the requests join together, not as their threads happen to start

        def handler(i: int) -> None:
            go.wait()
            req = ipb.DecodeRequest(request_id=rids[i], first_token=1, prompt_tokens=ctx)
            req.sampling.max_tokens = steps + 1
            for msg in service.Decode(req, _Call()):
                msg.SerializeToString()
                counts[i] += len(msg.token_ids)

        threads = [threading.Thread(target=handler, args=(i,)) for i in range(batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert counts == [steps] * batch, counts
    else:
        outs = [sched.start_decoding(rid, ctx, 1, params) for rid in rids]
        for out in outs:
            n = 0
            while not isinstance(item := out.get(timeout=120), Finished):
                n += len(item)
            assert n == steps and item.reason == "length", (n, item)
    return _full_batch_steps(stamps.rows, batch)


@torch.inference_mode()
def _bare_round(model, cache, batch: int, ctx: int, steps: int) -> list[float]:
    seqs = [cache.try_reserve(f"bare-{i}", ctx + steps + 1) for i in range(batch)]
    params = [SamplingParams(max_new_tokens=steps + 1)] * batch
    tokens, out = [1] * batch, []
    for s in seqs:
        s.num_tokens = ctx
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens = sample(model.decode_step(cache, seqs, tokens), params, [s.num_tokens for s in seqs])
        out.append(time.perf_counter() - t0)
    for s in seqs:
        cache.release(s)
    cache.check_integrity()
    return out


def _us(s: dict) -> dict:
    """``bench.common.summary`` in microseconds: median_us, min_us, max_us, p90_us, n."""
    return {k.replace("_s", "_us"): (round(v * 1e6, 1) if k != "n" else v) for k, v in s.items()}


def loop_rows(model, batches: list[int], ctx: int, steps: int, rounds: int) -> list[dict]:
    rows = []
    for batch in batches:
        pages = batch * (-(-(ctx + steps + 1) // BLOCK))
        stamps = StepStamps()
        sched = DecodeScheduler(model, pages, batch, BLOCK, max_batch=batch, metrics=stamps)
        bare_cache = model.new_cache(pages, batch, BLOCK)
        sched.start()
        try:
            _bare_round(model, bare_cache, batch, ctx, 4)  # warm-up of both paths
            _loop_round(sched, stamps, batch, ctx, 4, False, "warm")
            got: dict[str, list[float]] = {"bare": [], "loop": [], "loop_rpc": []}
            model_s: dict[str, list[float]] = {"loop": [], "loop_rpc": []}
            per_round: dict[str, list[float]] = {"bare": [], "loop": [], "loop_rpc": []}
            over: dict[str, list[float]] = {"loop": [], "loop_rpc": []}
            own: dict[str, list[float]] = {"loop": [], "loop_rpc": []}
            arms = ["bare", "loop", "loop_rpc"]
            for r in range(rounds):
                for arm in arms[r % 3:] + arms[: r % 3]:
                    if arm == "bare":
                        xs = _bare_round(model, bare_cache, batch, ctx, steps)
                    else:
                        xs, ms = _loop_round(sched, stamps, batch, ctx, steps, arm == "loop_rpc", f"{arm}{r}")
                        model_s[arm] += ms
                        over[arm] += [x - m for x, m in zip(xs, ms, strict=True)]
                        own[arm] += [x / m for x, m in zip(xs, ms, strict=True)]
                    got[arm] += xs
                    # A round where load from elsewhere staggered the joins so much that no two
                    # full-batch steps followed each other has no figure.
                    per_round[arm].append(statistics.median(xs) if xs else math.nan)
            sched.check_integrity()
        finally:
            sched.stop()
        bare = statistics.median(got["bare"])
        row: dict = {"batch": batch, "context": ctx, "steps_per_round": steps, "rounds": rounds,
                     "bare_us": _us(summary(got["bare"]))}
        for arm in ("loop", "loop_rpc"):
            med = statistics.median(got[arm])
            row[arm] = {
                "step_us": _us(summary(got[arm])), "in_loop_model_us": _us(summary(model_s[arm])),
                "overhead_us": _us(summary(over[arm])),
                "ratio": round(med / bare, 4),
                "ratio_to_own_model_step": round(statistics.median(own[arm]), 4),
                "ratio_per_round": [round(a / b, 3) for a, b in zip(per_round[arm], per_round["bare"], strict=True)
                                    if not math.isnan(a)],
                "overhead_share_of_step": round(statistics.median(over[arm]) / med, 5),
            }
        rows.append(row)
        print(f"batch {batch}: bare {bare * 1e3:.2f} ms, loop x{row['loop']['ratio']:.3f} "
              f"(+{row['loop']['overhead_us']['median_us']:.0f} us), loop_rpc x{row['loop_rpc']['ratio']:.3f} "
              f"(+{row['loop_rpc']['overhead_us']['median_us']:.0f} us)", file=sys.stderr)
    return rows


def throughput_ratios(rows: list[dict]) -> dict:
    """Tokens per second of the decode worker's loop at each batch over batch 1 (goal: at least
    6x at batch 32): B * (median step at batch 1) / (median step at batch B)."""
    by_batch = {row["batch"]: row["loop"]["step_us"]["median_us"] for row in rows}
    if 1 not in by_batch:
        return {}
    return {f"batch_{b}": round(b * by_batch[1] / us, 2) for b, us in by_batch.items() if b != 1}


class _NullModel:
    """A model whose decode step costs nothing, so a loop step is the loop's own work (and
    sampling's argmax over the logits)."""

    def __init__(self, model) -> None:
        self.model = model
        self.logits = torch.zeros(64, model.cfg.vocab_size)

    def new_cache(self, num_pages: int, num_slots: int, block_size: int):
        return self.model.new_cache(num_pages, num_slots, block_size)

    def decode_step(self, cache, seqs, token_ids) -> torch.Tensor:
        for s in seqs:
            s.num_tokens += 1
        return self.logits[: len(seqs)]


def null_rows(model, batches: list[int], ctx: int, steps: int, rounds: int) -> list[dict]:
    """Per batch, the loop's own work per step (interval - in-loop model) with a null model."""
    rows = []
    for batch in batches:
        null = _NullModel(model)
        stamps = StepStamps()
        sched = DecodeScheduler(null, batch * (-(-(ctx + steps + 1) // BLOCK)), batch, BLOCK, max_batch=batch,
                                metrics=stamps)
        sched.start()
        row: dict = {"batch": batch}
        try:
            over: dict[str, list[float]] = {"loop": [], "loop_rpc": []}
            for r in range(rounds):
                for arm in ("loop", "loop_rpc") if r % 2 == 0 else ("loop_rpc", "loop"):
                    xs, ms = _loop_round(sched, stamps, batch, ctx, steps, arm == "loop_rpc", f"null-{arm}{r}")
                    over[arm] += [x - m for x, m in zip(xs, ms, strict=True)]
        finally:
            sched.stop()
        for arm, xs in over.items():
            row[f"{arm}_overhead_us"] = _us(summary(xs))
        rows.append(row)
        print(f"null model, batch {batch}: loop +{row['loop_overhead_us']['median_us']:.0f} us, loop_rpc "
              f"+{row['loop_rpc_overhead_us']['median_us']:.0f} us per step", file=sys.stderr)
    return rows


# ---- the Conductor ---------------------------------------------------------------------------
def forward_in_process(positions: list[int], tokens_per_sample: int, repeats: int) -> list[dict]:
    """Per-token time of the Conductor's forwarding path at each stream position."""
    from conductor.client_stream import ClientStream
    from conductor.clock import SystemClock
    from conductor.config import SLO, SLOTable
    from conductor.metrics import ConductorMetrics
    from conductor.validation import ValidRequest

    tok = engine.load_tokenizer("tiny")
    req = ValidRequest(tuple(range(1, 33)), SamplingParams(max_new_tokens=1 << 16), 300.0, "")
    out = []
    for pos in positions:
        samples = []
        for _ in range(repeats):
            stream = ClientStream("r", req, tok, ConductorMetrics("tiny", "bench", registry=CollectorRegistry()),
                                  SLOTable(SLO(10.0, 1.0)), SystemClock())
            filler = tuple(40 + i % 80 for i in range(64))
            for _ in range(pos // 64):  # get to the position in 64-token messages
                stream.more(filler)
            wire = [ipb.DecodeResponse(token_ids=[40 + (pos + i) % 80]).SerializeToString()
                    for i in range(tokens_per_sample)]
            t0 = time.perf_counter()
            for raw in wire:  # as grpc_dispatch.decode and lifecycle._forward do, one token a message
                msg = ipb.DecodeResponse.FromString(raw)
                stream.more(tuple(msg.token_ids)).SerializeToString()
            samples.append((time.perf_counter() - t0) / tokens_per_sample)
        out.append({"position": pos, "per_token_us": _us(summary(samples))})
        print(f"conductor forwarding at token {pos}: {statistics.median(samples) * 1e6:.1f} us/token",
              file=sys.stderr)
    return out


def _step_hist(address: str) -> tuple[float, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    got = {}
    for line in text.splitlines():
        for key in ("sum", "count"):
            if line.startswith(f"tidekv:decode_step_seconds_{key}{{"):
                got[key] = float(line.rsplit(" ", 1)[1])
    return got["sum"], got["count"]


def forward_cluster(num_tokens: int, cpu_every: int, threads: int, idle_s: float = 3.0) -> dict:
    from conductor.client import Client
    from deploy.local import ClusterConfig, LocalCluster

    cfg = ClusterConfig(threads_per_process=threads, conductor_args=("--max-new-tokens", str(num_tokens)))
    with LocalCluster(cfg) as cluster:
        client = Client(cluster.endpoint)
        decode_metrics = next(w.metrics_address for w in cluster.workers().workers
                              if w.worker_id.startswith("decode"))
        pids = {"conductor": cluster.procs["conductor"].pid, "decode": cluster.procs["decode-0"].pid}
        client.generate(Client.request(list(range(1, 65)), max_tokens=32))  # warm the path
        # What the Conductor burns with no request (heartbeats, registry, metrics), per second.
        idle = (time.perf_counter(), process_cpu_s(pids["conductor"]))
        time.sleep(idle_s)
        idle_rate = (process_cpu_s(pids["conductor"]) - idle[1]) / (time.perf_counter() - idle[0])
        before = _step_hist(decode_metrics)
        stamps: list[tuple[float, int]] = []
        cpu: list[tuple[int, float, float, float]] = []  # (tokens, wall, Conductor CPU, decode worker CPU)
        n = 0
        req = Client.request(list(range(1, 65)), max_tokens=num_tokens)
        for msg in client.stub.Generate(req, timeout=600):
            now = time.perf_counter()
            if msg.token_ids:
                n += len(msg.token_ids)
                stamps.append((now, len(msg.token_ids)))
                if not cpu or n - cpu[-1][0] >= cpu_every:
                    cpu.append((n, now, process_cpu_s(pids["conductor"]), process_cpu_s(pids["decode"])))
        cpu.append((n, time.perf_counter(), process_cpu_s(pids["conductor"]), process_cpu_s(pids["decode"])))
        after = _step_hist(decode_metrics)
        client.close()
    gaps = [(b[0] - a[0]) / b[1] for a, b in zip(stamps[1:], stamps[2:], strict=False)]  # after the 2nd message
    steps = after[1] - before[1]
    step_mean_s = (after[0] - before[0]) / steps
    segments = [{"tokens": f"{a[0]}-{b[0]}", "wall_s": round(b[1] - a[1], 3),
                 "conductor_cpu_us_per_token": round((b[2] - a[2]) / (b[0] - a[0]) * 1e6, 1),
                 "conductor_cpu_us_per_token_less_idle":
                     round((b[2] - a[2] - idle_rate * (b[1] - a[1])) / (b[0] - a[0]) * 1e6, 1),
                 "decode_worker_cpu_us_per_token": round((b[3] - a[3]) / (b[0] - a[0]) * 1e6, 1)}
                for a, b in zip(cpu, cpu[1:], strict=False) if b[0] > a[0]]
    gap_med = statistics.median(gaps)
    # The histogram gives only the steps' mean, so the comparison is mean to mean: the stream's
    # wall time after its second message per token, against the worker's mean model step.
    gap_mean_s = (stamps[-1][0] - stamps[1][0]) / sum(k for _, k in stamps[2:])
    out = {
        "num_tokens": n, "messages": len(stamps), "decode_steps": int(steps),
        "client_gap_us": _us(summary(gaps)),
        "client_gap_mean_us": round(gap_mean_s * 1e6, 1),
        "decode_step_mean_us": round(step_mean_s * 1e6, 1),
        "gap_minus_step_us": round((gap_mean_s - step_mean_s) * 1e6, 1),
        "gap_over_step": round(gap_mean_s / step_mean_s, 4),
        "conductor_idle_cpu_share": round(idle_rate, 4),
        "cpu_segments": segments,
        "cpu_clock_tick_s": 1 / os.sysconf("SC_CLK_TCK"),
    }
    print(f"cluster: client gap median {gap_med * 1e6:.0f}, mean {gap_mean_s * 1e6:.0f} us/token, decode step mean "
          f"{step_mean_s * 1e6:.0f} us; Conductor CPU "
          f"per token less idle {[s['conductor_cpu_us_per_token_less_idle'] for s in segments]}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer rounds and tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a decode worker of `tidekv up` uses 1)")
    ap.add_argument("--context", type=int, default=256, help="tokens each sequence holds when a round starts")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=0, help="0: 7 (2 with --quick)")
    ap.add_argument("--steps", type=int, default=0, help="decode steps per round and arm; 0: 32 (12 with --quick)")
    ap.add_argument("--stream-tokens", type=int, default=0, help="0: 2048 (512 with --quick)")
    ap.add_argument("--cpu-every", type=int, default=512)
    ap.add_argument("--skip-cluster", action="store_true")
    ap.add_argument("--skip-loop", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    rounds = args.rounds or (2 if args.quick else 7)
    steps = args.steps or (12 if args.quick else 32)
    stream_tokens = args.stream_tokens or (512 if args.quick else 2048)
    model = engine.load_model("tiny")
    result: dict = {"threads": args.threads, "block_size": BLOCK}
    if not args.skip_loop:
        batches = [int(b) for b in args.batches.split(",")]
        result["loop"] = loop_rows(model, batches, args.context, steps, rounds)
        result["throughput_over_batch_1"] = throughput_ratios(result["loop"])
        result["loop_null_model"] = null_rows(model, batches, args.context, 200, rounds)
    positions = [0, 1024, 4096] if not args.quick else [0, 1024]
    result["conductor"] = {"in_process": forward_in_process(positions, 256, 5 if not args.quick else 3)}
    if not args.skip_cluster:
        result["conductor"]["cluster"] = forward_cluster(stream_tokens, args.cpu_every, args.threads)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
