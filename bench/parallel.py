"""Parallel instances against one instance on the same cores (issue 22's figures).

Prints JSON with, for the built-in ``tiny`` model (6 layers: 2 KDA + 1 MLA per stage of 2,
hidden 256) and, for ``tp``, also ``wide`` (the same at hidden 512, 52M parameters, written as
a seeded checkpoint for the run; ``--tp-models``):

- ``cpp``: time to first token of one long prompt (``--prompt-tokens``, 16,384) at the engine:
  the prefill, in the worker's snapshot-cut chunks, and the first token sampled. Chunked
  pipeline parallelism over 2 stages (2 processes, 1 thread each, chunks of ``--cpp-chunk``)
  against one instance with 1 thread (the scaling ratio; goal >= 1.6x) and with 2 threads
  (the same cores).
- ``tp``: prefill throughput of ``--tp-prompts`` prompts of ``--tp-tokens`` each, TP=2 (2
  processes, 1 thread each) against TP=1 with 1 thread (goal >= 1.6x) and 2 threads; the
  decode step at batch 8 the same three ways; the share of TP=2's time in its collectives. The
  ranks of one host sum through shared memory (``engine.parallel.host_reduce``); TP=2 summing
  with gloo over loopback (``tp2_1_thread_each_gloo_sums``) is the baseline for that choice.
  At hidden 256 per-op overheads (Python, the MoE's dispatch on every rank) are a large part of
  a layer and do not divide over ranks; at 512 the matmuls dominate, as in any model served
  with TP.
- ``ep``: the same prefill with EP=2. Dispatch is all-gather style: attention (here replicated)
  leaves every token on every rank, each rank runs its experts on the tokens routed to them,
  and one all-reduce per MoE layer combines them (``engine.parallel.comm``); the figure shows
  what that all-reduce costs.

- ``cluster`` (``--cluster``): the same CPP comparison through a real local cluster (Conductor,
  one prefill instance, one decode instance, gRPC and the KV transfer): the client's TTFT of a
  prompt of ``--cluster-prompt-tokens`` (the built-in model's limit is 8,192), CPP over 2 stages
  against one prefill instance with 1 and with 2 threads.

Each configuration runs in fresh processes, the configurations alternating repeat by repeat
(``--repeats``) so that load from other processes hits them alike; medians with min and max.
The machine's load average before and after is reported: the scaling ratios need both cores
free. Usage: python -m bench.parallel [--quick] [--repeats N] [--groups cpp,tp] [--tp-models tiny,wide]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import summary

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 32
SNAPSHOT_EVERY = 64  # blocks: the worker's snapshot points for a long prompt (cuts in the prefill)


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 131 + salt * 7919) % 250 + 1 for i in range(n)]


# ---- one rank's side (run in its own process) ------------------------------------------------
def _model(args):
    import engine
    from engine.parallel.instance import RankSpec, join
    from engine.parallel.shape import ParallelShape

    shape = ParallelShape(tp=args.tp, ep=args.ep, stages=args.stages)
    if shape.is_single:
        return engine.load_model(args.model)
    return join(RankSpec(args.model, shape, args.rank, args.init, timeout_s=300, host_sums=not args.gloo_sums))


def _ttft(model, n: int, pipe: int) -> float:
    import engine

    cache = model.new_cache(num_pages=n // BLOCK + 2, num_slots=1, block_size=BLOCK)
    seq = cache.try_reserve("ttft", n)
    points = [(i + 1) * BLOCK * SNAPSHOT_EVERY for i in range(n // (BLOCK * SNAPSHOT_EVERY))]
    kw = {"pipeline_chunk_tokens": pipe} if getattr(model, "pipelined", False) else {}
    t0 = time.perf_counter()
    logits = model.prefill(cache, seq, _prompt(n, 1), snapshot_at=points, **kw)
    engine.sample(logits, [engine.SamplingParams(max_new_tokens=1)], [n])
    took = time.perf_counter() - t0
    cache.release(seq)
    return took


def _throughput(model, num: int, n: int) -> dict:
    cache = model.new_cache(num_pages=num * (n // BLOCK + 4), num_slots=num, block_size=BLOCK)
    seqs = [cache.try_reserve(f"p{i}", n + 40) for i in range(num)]
    comm = getattr(getattr(model, "shard", None), "comm", None)
    if comm is not None:
        comm.stats.reset()
    t0 = time.perf_counter()
    for i, seq in enumerate(seqs):
        model.prefill(cache, seq, _prompt(n, 10 + i))
    prefill_s = time.perf_counter() - t0
    comm_s = comm.stats.total_s if comm is not None else 0.0
    batch = seqs[:8]
    model.decode_step(cache, batch, [1] * len(batch))  # warm
    t0 = time.perf_counter()
    for _ in range(16):
        model.decode_step(cache, batch, [1] * len(batch))
    step_s = (time.perf_counter() - t0) / 16
    return {"prefill_tokens_per_s": num * n / prefill_s, "prefill_s": prefill_s, "comm_share": comm_s / prefill_s,
            "decode_step_s": step_s}


def _rank_main(args) -> None:
    from engine.parallel.group import leave_group

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    model = _model(args)
    try:
        _rank_work(args, model)
    finally:
        leave_group()  # gloo's threads must be gone before the interpreter exits


def _rank_work(args, model) -> None:
    with torch.inference_mode():
        if hasattr(model, "run"):  # a follower
            model.run()
            return
        if args.task == "ttft":
            _ttft(model, 2048, args.cpp_chunk)  # warm up
            result: dict = {"ttft_s": _ttft(model, args.prompt_tokens, args.cpp_chunk)}
        else:
            _throughput(model, 2, 256)  # warm up
            result = _throughput(model, args.tp_prompts, args.tp_tokens)
        if hasattr(model, "close"):
            model.close()
    Path(args.out).write_text(json.dumps(result))


# ---- the driver --------------------------------------------------------------------------------
def _run(args, task: str, threads: int, model: str, tp: int = 1, ep: int = 1, stages: int = 1,
         gloo: bool = False) -> dict:
    world = tp * ep * stages
    with tempfile.TemporaryDirectory(prefix="tidekv-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "bench.parallel", "rank", "--task", task, "--threads", str(threads),
               "--tp", str(tp), "--ep", str(ep), "--stages", str(stages), "--init", f"file://{tmp}/rendezvous",
               "--out", str(out), "--model", model, "--prompt-tokens", str(args.prompt_tokens),
               "--cpp-chunk", str(args.cpp_chunk), "--tp-prompts", str(args.tp_prompts),
               "--tp-tokens", str(args.tp_tokens), *(["--gloo-sums"] if gloo else [])]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
        procs = [subprocess.Popen([*cmd, "--rank", str(r)], cwd=ROOT, env=env) for r in range(world)]
        codes = [p.wait(timeout=1800) for p in procs]
        if any(codes):
            raise RuntimeError(f"{task} tp={tp} ep={ep} stages={stages}: ranks exited with {codes}")
        return json.loads(out.read_text())


def _cluster_ttfts(args, prefill_args: tuple[str, ...], threads: int) -> list[float]:
    """Client TTFTs of ``--repeats`` long prompts (each new: no reuse) through a local cluster
    whose one prefill instance runs with ``prefill_args`` and ``threads``."""
    from conductor.client import Client
    from deploy.local import ClusterConfig, LocalCluster

    n = args.cluster_prompt_tokens
    pages = n // BLOCK + 8
    config = ClusterConfig(
        num_prefill=1, num_decode=1, model=args.model, prefill_nice=0,
        prefill_args=("--block-size", str(BLOCK), "--snapshot-interval-blocks", str(SNAPSHOT_EVERY),
                      "--num-pages", str(pages), "--threads", str(threads), *prefill_args),
        decode_args=("--block-size", str(BLOCK), "--num-pages", str(pages + 64)))
    with LocalCluster(config) as cluster:
        client = Client(cluster.endpoint)
        try:
            client.generate(Client.request(_prompt(1024, 999), max_tokens=1))  # warm
            return [client.generate(Client.request(_prompt(n, 1000 + i), max_tokens=1)).ttft_s
                    for i in range(args.repeats)]
        finally:
            client.close()


def _cluster(args) -> dict:
    runs = {"one_instance_1_thread": _cluster_ttfts(args, (), 1),
            "one_instance_2_threads": _cluster_ttfts(args, (), 2),
            "cpp_2_stages_1_thread_each": _cluster_ttfts(
                args, ("--cpp-stages", "2", "--cpp-chunk-tokens", str(args.cpp_chunk)), 1)}
    ttft = {name: summary(r) for name, r in runs.items()}
    piped = ttft["cpp_2_stages_1_thread_each"]["median_s"]
    return {"prompt_tokens": args.cluster_prompt_tokens, "ttft": ttft,
            "speedup_vs_1_thread": ttft["one_instance_1_thread"]["median_s"] / piped,
            "speedup_vs_2_threads": ttft["one_instance_2_threads"]["median_s"] / piped}


def _series(runs: list[dict], key: str) -> dict:
    return summary([r[key] for r in runs])


# The comparisons: name -> (task, threads per rank, shape and options).
CPP = {"one_instance_1_thread": ("ttft", 1, {}), "one_instance_2_threads": ("ttft", 2, {}),
       "cpp_2_stages_1_thread_each": ("ttft", 1, {"stages": 2})}
TP = {"tp1_1_thread": ("throughput", 1, {}), "tp1_2_threads": ("throughput", 2, {}),
      "tp2_1_thread_each": ("throughput", 1, {"tp": 2}),
      "tp2_1_thread_each_gloo_sums": ("throughput", 1, {"tp": 2, "gloo": True}),
      "ep2_1_thread_each": ("throughput", 1, {"ep": 2})}


def _write_wide(directory: Path) -> str:
    """The ``wide`` model's checkpoint (seeded weights) under ``directory``: the tiny model at
    hidden 512 (52M parameters), where the matmuls rather than per-op overheads set the time."""
    from engine.checkpoint import save_checkpoint, seeded_tensors
    from engine.config import tiny_config

    cfg = dataclasses.replace(tiny_config(), hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                              kv_lora_rank=256, kda_num_heads=8, kda_head_dim=64, moe_intermediate_size=512,
                              name="wide")
    save_checkpoint(directory, cfg, seeded_tensors(cfg, seed=7))
    return str(directory)


def _describe(model: str) -> dict:
    import engine

    cfg = engine.load_config(model)
    return {"hidden_size": cfg.hidden_size, "layers": cfg.num_hidden_layers, "experts": cfg.num_experts,
            "attention_heads": cfg.num_attention_heads}


def _cpp_report(args, runs: dict[str, list[dict]]) -> dict:
    cpp = {name: _series(r, "ttft_s") for name, r in runs.items()}
    base1, base2 = cpp["one_instance_1_thread"]["median_s"], cpp["one_instance_2_threads"]["median_s"]
    piped = cpp["cpp_2_stages_1_thread_each"]["median_s"]
    return {"prompt_tokens": args.prompt_tokens, "chunk_tokens": args.cpp_chunk, "ttft": cpp,
            "speedup_vs_1_thread": base1 / piped, "speedup_vs_2_threads": base2 / piped, "goal_vs_1_thread": 1.6}


def _tp_report(args, runs: dict[str, list[dict]]) -> dict:
    tp = {name: {key: _series(r, key) for key in ("prefill_tokens_per_s", "decode_step_s", "comm_share")}
          for name, r in runs.items()}
    tput = {name: v["prefill_tokens_per_s"]["median_s"] for name, v in tp.items()}
    return {"prompts": args.tp_prompts, "tokens_each": args.tp_tokens, "runs": tp,
            "tp2_speedup_vs_1_thread": tput["tp2_1_thread_each"] / tput["tp1_1_thread"],
            "tp2_speedup_vs_2_threads": tput["tp2_1_thread_each"] / tput["tp1_2_threads"],
            "tp2_gloo_sums_speedup_vs_1_thread": tput["tp2_1_thread_each_gloo_sums"] / tput["tp1_1_thread"],
            "ep2_speedup_vs_1_thread": tput["ep2_1_thread_each"] / tput["tp1_1_thread"],
            "goal_vs_1_thread": 1.6,
            "ep_dispatch": "all-gather style: tokens on every rank, experts partitioned, one all-reduce "
                           "combines (comm_share of ep2_1_thread_each is its cost)"}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.parallel")
    p.add_argument("mode", nargs="?", default="bench", choices=["bench", "rank"])
    p.add_argument("--quick", action="store_true", help="short prompts and one repeat (a smoke run)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompt-tokens", type=int, default=16_384)
    p.add_argument("--cpp-chunk", type=int, default=1024)
    p.add_argument("--tp-prompts", type=int, default=4)
    p.add_argument("--tp-tokens", type=int, default=2048)
    p.add_argument("--groups", default="cpp,tp", help="which comparisons to run: cpp, tp (with ep), or both")
    p.add_argument("--tp-models", default="tiny,wide",
                   help="models of the tp/ep comparison: built-in names, checkpoint directories, or 'wide'")
    p.add_argument("--cluster", action="store_true", help="also the CPP comparison through a real local cluster")
    p.add_argument("--cluster-prompt-tokens", type=int, default=8000)
    # a rank's own flags
    p.add_argument("--task", default="ttft")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--init", default="")
    p.add_argument("--out", default="")
    p.add_argument("--gloo-sums", action="store_true", help="sum with gloo, not through shared memory")
    args = p.parse_args(argv)
    if args.mode == "rank":
        _rank_main(args)
        return
    if args.quick:
        args.repeats, args.prompt_tokens, args.tp_tokens, args.tp_prompts = 1, 4096, 1024, 2
        args.cluster_prompt_tokens = min(args.cluster_prompt_tokens, 2048)
    load_before = os.getloadavg()
    wanted = set(args.groups.split(","))
    with tempfile.TemporaryDirectory(prefix="tidekv-bench-wide-") as wide_dir:
        tp_models = [m.strip() for m in args.tp_models.split(",") if m.strip()] if "tp" in wanted else []
        paths = {m: (_write_wide(Path(wide_dir)) if m == "wide" else m) for m in tp_models}
        described = {m: _describe(paths[m]) for m in tp_models}
        configs = {("cpp", args.model): CPP} if "cpp" in wanted else {}
        configs.update({("tp", m): TP for m in tp_models})
        runs = {key: {name: [] for name in c} for key, c in configs.items()}
        for rep in range(args.repeats):
            for (group, model), cs in configs.items():
                for name, (task, threads, shape) in cs.items():
                    runs[group, model][name].append(_run(args, task, threads, paths.get(model, model), **shape))
                    print(f"repeat {rep + 1}/{args.repeats}: {group} {model} {name} done", file=sys.stderr, flush=True)
    result: dict = {
        "machine": {"cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                    "note": "a shared host: the ratios need both cores free (compare the load averages)"},
        "model": args.model, "repeats": args.repeats,
    }
    if "cpp" in wanted:
        result["cpp"] = _cpp_report(args, runs["cpp", args.model])
    if tp_models:
        result["tp"] = {m: _tp_report(args, runs["tp", m]) for m in tp_models}
        result["tp"]["models"] = described
    if args.cluster:
        result["cluster"] = _cluster(args)
    result["machine"]["load_avg_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
