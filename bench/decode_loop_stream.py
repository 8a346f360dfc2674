"""The ``conductor`` part of ``bench.decode_loop`` (see its docstring): the per-token cost of
forwarding a decode stream through the Conductor, ``forward_in_process`` (its per-token path timed
in this process at several stream positions) and ``forward_cluster`` (a ``LocalCluster`` 1x1
streaming one long request: the client's gaps against the decode worker's step histogram, and
the Conductor's and the decode worker's CPU per token from ``/proc``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import urllib.request

from prometheus_client import CollectorRegistry

import engine
from bench.common import process_cpu_s, summary
from bench.decode_loop_steps import summary_us
from engine import SamplingParams
from proto import internal_pb2 as ipb


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
        out.append({"position": pos, "per_token_us": summary_us(summary(samples))})
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
        "client_gap_us": summary_us(summary(gaps)),
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
