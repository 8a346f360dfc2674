"""Cost of the Prometheus instrumentation, metrics on vs off in the same run (JSON to stdout).

- decode ITL: a real ``DecodeScheduler`` (tiny model) decoding a batch of requests; the time
  between consecutive tokens of each request, p50 and p99. On: ``DecodeMetrics`` with its
  registry served over HTTP and scraped every second (as Prometheus would); off: disabled.
- Conductor requests/s: the real ``RequestLife`` and ``ConductorCore`` (mooncake policy, a
  ``Cluster`` over its in-memory state with one prefill and one decode worker) over a dispatcher
  that answers at once, so the figure is the Conductor's own cost per request. On:
  ``ConductorMetrics``; off: ``ConductorMetrics.disabled()``.
On and off alternate in rounds so drift affects both alike.

    python -m bench.metrics [--rounds 3] [--requests 400] [--decode-tokens 64] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator

from prometheus_client import CollectorRegistry

import engine
from conductor.clock import SystemClock
from conductor.cluster import Cluster
from conductor.config import ConductorConfig
from conductor.core import ConductorCore
from conductor.dispatch import DecodeChunk, PrefillCall, PrefillResult
from conductor.lifecycle import ITL_BATCH_TOKENS, RequestLife
from conductor.metrics import ConductorMetrics
from conductor.routing import PolicyContext, make_policy
from conductor.validation import ValidRequest
from costmodel.builtin import tiny_cpu_estimate
from decode_worker.metrics import DecodeMetrics
from decode_worker.scheduler import DecodeScheduler, Finished
from engine.sampling_params import SamplingParams
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb
from runtime.auth import CONDUCTOR, Member, worker_principal
from runtime.metrics import Identity, TenantLabels, start_metrics
from runtime.settings import setup_torch


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class _Scraper:
    """Fetches a /metrics URL every ``interval_s`` until stopped (a Prometheus stand-in)."""

    def __init__(self, url: str, interval_s: float = 1.0):
        self.url, self.interval_s, self.scrapes = url, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            urllib.request.urlopen(self.url, timeout=5).read()
            self.scrapes += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def decode_intervals(model, metrics: DecodeMetrics | None, batch: int, num_tokens: int) -> list[float]:
    scheduler = DecodeScheduler(model, 64 * batch, batch, 16, max_batch=batch, metrics=metrics)
    scheduler.start()
    try:
        outs, stamps = [], []
        for i in range(batch):
            assert scheduler.try_reserve(f"r{i}", 32 + num_tokens) is not None
            times: list[float] = []
            out = scheduler.start_decoding(f"r{i}", 32, 7 + i, SamplingParams(max_new_tokens=num_tokens))
            out.put = _stamped(out.put, times)  # the moment the loop hands the token over
            outs.append(out)
            stamps.append(times)
        for out in outs:
            while not isinstance(out.get(timeout=60), Finished):
                pass
        return [b - a for times in stamps for a, b in zip(times, times[1:], strict=False)]
    finally:
        scheduler.stop()


def _stamped(put, times: list[float]):
    def stamped_put(item, *args, **kwargs):
        if isinstance(item, list):
            times.append(time.perf_counter())
        return put(item, *args, **kwargs)

    return stamped_put


class _InstantDispatcher:
    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens

    def reserve(self, decode_worker, request_id, num_prompt_tokens, max_tokens, deadline_s) -> str:
        return "tcp://127.0.0.1:1"

    def prefill(self, prefill_worker, call: PrefillCall, on_cancel) -> PrefillResult:
        return PrefillResult(5, 0, 0.0)

    def decode(self, decode_worker, request_id, first_token, sampling, num_prompt_tokens, deadline_s,
               on_cancel) -> Iterator[DecodeChunk]:
        for i in range(self.num_tokens - 2):
            yield DecodeChunk((6 + i % 100,))
        yield DecodeChunk((9,), pb.FINISH_REASON_LENGTH)

    def release(self, decode_worker, request_id) -> None:
        pass


def conductor_core(config: ConductorConfig) -> ConductorCore:
    cluster = Cluster.in_memory(Member(b"in-process" * 8, CONDUCTOR), ttl_s=3600)
    fp = engine.load_model("tiny").fingerprint
    for worker_id, role in (("prefill-0", ipb.WORKER_ROLE_PREFILL), ("decode-0", ipb.WORKER_ROLE_DECODE)):
        cluster.register(ipb.WorkerInfo(worker_id=worker_id, role=role, rpc_address="127.0.0.1:1",
                                        transfer_address="tcp://127.0.0.1:1", model_fingerprint=fp, block_size=16,
                                        num_pages_total=100_000, instance_id="i" * 32),
                         worker_principal(worker_id))
        cluster.heartbeat(worker_id, ipb.WorkerLoad(num_free_pages=100_000, timestamp_s=time.time()), [])
    policy = make_policy(config.policy, PolicyContext(config.routing, tiny_cpu_estimate()))
    return ConductorCore(cluster, policy, config.slos, SystemClock())


def conductor_rps(core: ConductorCore, metrics: ConductorMetrics, num_requests: int, num_tokens: int) -> float:
    tokenizer = engine.load_tokenizer("tiny")
    dispatcher = _InstantDispatcher(num_tokens)
    t0 = time.perf_counter()
    for i in range(num_requests):
        prompt = tuple((i * 7 + t) % 250 + 1 for t in range(64))
        req = ValidRequest(prompt, SamplingParams(max_new_tokens=num_tokens), 60.0, f"tenant-{i % 5}")
        life = RequestLife(core, dispatcher, tokenizer, req, uuid.uuid4().hex, i, 2, metrics)
        for _ in life.run():
            pass
    return num_requests / (time.perf_counter() - t0)


def metrics_us_per_request(metrics: ConductorMetrics, num_tokens: int, repeats: int = 2000) -> float:
    """The Conductor's metrics calls for one request alone (what the lifecycle adds), in µs."""
    intervals = [0.01] * (ITL_BATCH_TOKENS - 1)
    t0 = time.perf_counter()
    for i in range(repeats):
        tenant = f"tenant-{i % 5}"
        metrics.routed("cold")
        metrics.first_token(tenant, 0.1, 0.01, 64, 32, "dram")
        for _ in range(0, num_tokens, ITL_BATCH_TOKENS):
            metrics.tokens(tenant, intervals)
        metrics.ended(tenant, "length", "", 64, num_tokens, 1.0, True)
        metrics.prediction(0.1, 0.12)
    return 1e6 * (time.perf_counter() - t0) / repeats


def overhead_pct(on: float, off: float) -> float:
    return 100.0 * (on - off) / off


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.metrics")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)
    setup_torch(1)
    model = engine.load_model("tiny")
    registry = CollectorRegistry()
    server = start_metrics("127.0.0.1", 0, registry=registry)
    scraper = _Scraper(server.url)
    config = ConductorConfig(metrics_tenants=("tenant-0", "tenant-1"))
    core = conductor_core(config)
    on_metrics = ConductorMetrics("tiny", config.policy, TenantLabels(config.metrics_tenants), registry)
    itl: dict[str, list[float]] = {"on": [], "off": []}
    rps: dict[str, list[float]] = {"on": [], "off": []}
    try:
        decode_intervals(model, None, args.batch, 8)  # warm-up
        conductor_rps(core, ConductorMetrics.disabled(), 50, args.decode_tokens)
        for _ in range(args.rounds):
            for mode in ("on", "off"):
                metrics = DecodeMetrics(Identity("decode-bench", "decode", "tiny"), registry) if mode == "on" else None
                itl[mode] += decode_intervals(model, metrics, args.batch, args.decode_tokens)
                metrics = on_metrics if mode == "on" else ConductorMetrics.disabled()
                rps[mode].append(conductor_rps(core, metrics, args.requests, args.decode_tokens))
    finally:
        scraper.stop()
        server.stop()
    out = {"config": vars(args), "scrapes": scraper.scrapes,
           "conductor_metrics_us_per_request": metrics_us_per_request(on_metrics, args.decode_tokens)}
    for mode in ("on", "off"):
        out[f"decode_itl_{mode}"] = {"p50_ms": 1e3 * _percentile(itl[mode], 0.5),
                                     "p99_ms": 1e3 * _percentile(itl[mode], 0.99), "n": len(itl[mode])}
        out[f"conductor_{mode}"] = {"requests_per_s": statistics.median(rps[mode]), "rounds": rps[mode]}
    out["overhead_pct"] = {
        "decode_itl_p50": overhead_pct(out["decode_itl_on"]["p50_ms"], out["decode_itl_off"]["p50_ms"]),
        "decode_itl_p99": overhead_pct(out["decode_itl_on"]["p99_ms"], out["decode_itl_off"]["p99_ms"]),
        "conductor_requests_per_s": -overhead_pct(out["conductor_on"]["requests_per_s"],
                                                  out["conductor_off"]["requests_per_s"]),
        # Less noisy than the difference of two throughputs on a shared machine: the metrics
        # calls' own time over the time of one request without them.
        "conductor_metrics_share": 100.0 * out["conductor_metrics_us_per_request"] * 1e-6
        * out["conductor_off"]["requests_per_s"],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
