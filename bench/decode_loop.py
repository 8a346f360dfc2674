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
``in_loop_model_us`` is the hook's own figure for the model step and sampling of the same
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

import torch

import engine
from bench.decode_loop_steps import BLOCK, loop_rows, null_rows, throughput_ratios
from bench.decode_loop_stream import forward_cluster, forward_in_process


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
