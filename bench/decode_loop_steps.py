"""The ``loop`` and ``loop_null_model`` parts of ``bench.decode_loop`` (see its docstring): the
decode worker's loop timed per step against a bare ``model.decode_step`` + ``engine.sample`` loop.

``StepStamps`` is the worker's metrics hook, stamping every step; ``loop_rows`` runs the three
arms (``bare``, ``loop``, ``loop_rpc``: ``DecodeService.Decode`` without the transport, over the
fakes ``_KvReady`` and ``_Call``) round by round in a rotating order; ``null_rows`` runs the two
loop arms over ``_NullModel``, whose decode step does nothing; ``throughput_ratios`` is the
loop's tokens per second at each batch over batch 1. ``summary_us`` is ``bench.common.summary``
in microseconds, also used by ``bench.decode_loop_stream``.
"""

from __future__ import annotations

import math
import statistics
import sys
import threading
import time

import torch
from prometheus_client import CollectorRegistry

from bench.common import summary
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


def summary_us(s: dict) -> dict:
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
                     "bare_us": summary_us(summary(got["bare"]))}
        for arm in ("loop", "loop_rpc"):
            med = statistics.median(got[arm])
            row[arm] = {
                "step_us": summary_us(summary(got[arm])), "in_loop_model_us": summary_us(summary(model_s[arm])),
                "overhead_us": summary_us(summary(over[arm])),
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
            row[f"{arm}_overhead_us"] = summary_us(summary(xs))
        rows.append(row)
        print(f"null model, batch {batch}: loop +{row['loop_overhead_us']['median_us']:.0f} us, loop_rpc "
              f"+{row['loop_rpc_overhead_us']['median_us']:.0f} us per step", file=sys.stderr)
    return rows
