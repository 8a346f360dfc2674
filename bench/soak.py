"""Soak: trace replay against a local cluster for a fixed duration, watching every process for leaks.

The load is the Mooncake synthetic trace replayed live (``replay.live``) window after window
(each window drains before the next starts, the last one cut to the time left; the windows
walk through the trace and wrap at its end). Beside it one sampler thread records, every
``sample_every_s``, each process's RSS (``/proc/PID/status`` VmRSS), open file descriptors
(``/proc/PID/fd``) and threads, and each worker's free pages, live requests (reservations
included) and stored blocks (the ``Stats`` RPC). The JSON report holds per-series summaries,
each process's RSS slope (least squares, MB/min, over the whole run and over its second half,
after the prefix caches have filled), what is still held once the load has drained (pages not
free, live requests, the Conductor's running and queued requests), the request outcomes and
every process exit. The run always ends by itself: no window starts after ``duration_s`` and
every request is bounded by ``timeout_s``; the cluster and its temp dir are removed at the end.

Usage: python -m bench.soak [--minutes 30] [--sample-every-s 5] [--num-prefill 1] [--num-decode 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from deploy.local import ClusterConfig, LocalCluster
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from replay.live import run_live_replay
from replay.records import FINISHED
from replay.traces import SYNTHETIC_TRACE, read_trace
from replay.transform import ReplayRequest, TraceTransform, apply_transform
from runtime.auth import worker_principal

ROOT = Path(__file__).resolve().parents[1]
TRACE = SYNTHETIC_TRACE
BLOCK = 16
# Small store tiers, full within the first minutes: from then on a growing RSS is a leak, not the
# prefix cache filling up (the DRAM tier's default is 512 MB).
WORKER_ARGS = ("--block-size", str(BLOCK), "--snapshot-interval-blocks", "2", "--num-pages", "1024",
               "--dram-bytes", str(64 << 20), "--ssd-bytes", str(256 << 20))
DECODE_ARGS = ("--block-size", str(BLOCK), "--num-pages", "2048")


def log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 1800.0  # of load; the drain and the report come after it
    sample_every_s: float = 5.0
    num_prefill: int = 1
    num_decode: int = 1
    window_requests: int = 40  # requests per replayed window
    first_index: int = 0  # the trace index of the first window
    rate_scale: float = 1.0
    max_output_tokens: int = 32
    max_prompt_tokens: int = 1024
    max_concurrency: int = 16
    timeout_s: float = 120.0  # per request
    drain_timeout_s: float = 30.0  # for the workers to free everything after the load

    def transform(self, index_start: int) -> TraceTransform:
        # SLOs far above what the machine does: the soak loads the cluster, it does not shed load.
        return TraceTransform(block_size=BLOCK, output_scale=0.25, max_output_tokens=self.max_output_tokens,
                              max_prompt_tokens=self.max_prompt_tokens, rate_scale=self.rate_scale,
                              index_start=index_start, index_end=index_start + self.window_requests,
                              ttft_slo_s=600.0, tbt_slo_s=60.0)


@dataclass(frozen=True)
class ProcSample:
    t_s: float  # since the sampler started
    rss_mb: float  # = anon + file + shmem (the engine's KV pages live in a memfd: shmem)
    rss_anon_mb: float
    rss_file_mb: float
    rss_shmem_mb: float
    num_fds: int
    num_threads: int


@dataclass(frozen=True)
class WorkerSample:
    t_s: float
    num_free_pages: int
    num_pages_total: int
    num_live_requests: int
    num_blocks_stored: int


def read_proc(pid: int, t_s: float) -> ProcSample | None:
    """A live process's sample; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        num_fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    mb = {name: int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}
    return ProcSample(t_s, mb["VmRSS"], mb["RssAnon"], mb["RssFile"], mb["RssShmem"], num_fds,
                      int(fields["Threads"]))


def worker_stats(cluster: LocalCluster) -> dict[str, ipb.WorkerStats]:
    """Each registered worker's Stats (a worker that does not answer is left out)."""
    out = {}
    for info in cluster.workers().workers:
        ch = cluster.channel(info.rpc_address, worker_principal(info.worker_id))
        stub = igrpc.PrefillStub(ch) if info.role == ipb.WORKER_ROLE_PREFILL else igrpc.DecodeStub(ch)
        try:
            out[info.worker_id] = stub.Stats(ipb.StatsRequest(), timeout=5)
        except grpc.RpcError as e:
            log(f"stats of {info.worker_id}: {e.code().name}")
        finally:
            ch.close()
    return out


@dataclass
class Sampler:
    """One daemon thread sampling every process and worker of ``cluster`` until ``stop``."""

    cluster: LocalCluster
    every_s: float
    procs: dict[str, list[ProcSample]] = field(default_factory=dict)
    workers: dict[str, list[WorkerSample]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _t0: float = 0.0

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()  # the state at the end

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.every_s):
                return

    def sample(self) -> None:
        t = time.monotonic() - self._t0
        for name, p in self.cluster.procs.items():
            got = read_proc(p.pid, t)
            if got is not None:
                self.procs.setdefault(name, []).append(got)
        try:
            stats = worker_stats(self.cluster)
        except grpc.RpcError as e:  # the Conductor's registry did not answer: next time
            log(f"workers: {e.code().name}")
            return
        for wid, s in stats.items():
            self.workers.setdefault(wid, []).append(
                WorkerSample(t, s.num_free_pages, s.num_pages_total, s.num_live_requests, s.num_blocks_stored))


def slope_per_min(ts_s: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over time, per minute (None with fewer than 3 points)."""
    if len(ts_s) < 3 or max(ts_s) == min(ts_s):
        return None
    mt, my = statistics.fmean(ts_s), statistics.fmean(ys)
    num = sum((t - mt) * (y - my) for t, y in zip(ts_s, ys, strict=True))
    den = sum((t - mt) ** 2 for t in ts_s)
    return 60.0 * num / den


def series(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "first": values[0], "last": values[-1], "min": min(values), "max": max(values),
            "mean": statistics.fmean(values)}


def process_report(samples: list[ProcSample]) -> dict[str, Any]:
    ts, rss, anon = [s.t_s for s in samples], [s.rss_mb for s in samples], [s.rss_anon_mb for s in samples]
    half = len(ts) // 2
    return {"rss_mb": series(rss), "rss_anon_mb": series(anon), "rss_file_mb": series([s.rss_file_mb for s in samples]),
            "rss_shmem_mb": series([s.rss_shmem_mb for s in samples]), "num_fds": series([s.num_fds for s in samples]),
            "num_threads": series([s.num_threads for s in samples]),
            "rss_slope_mb_per_min": slope_per_min(ts, rss),
            "rss_slope_second_half_mb_per_min": slope_per_min(ts[half:], rss[half:]),
            "rss_anon_slope_second_half_mb_per_min": slope_per_min(ts[half:], anon[half:])}


def worker_report(samples: list[WorkerSample]) -> dict[str, Any]:
    return {"num_free_pages": series([s.num_free_pages for s in samples]),
            "num_pages_total": samples[-1].num_pages_total,
            "num_live_requests": series([s.num_live_requests for s in samples]),
            "num_blocks_stored": series([s.num_blocks_stored for s in samples])}


def conductor_gauges(cluster: LocalCluster) -> dict[str, float]:
    """The Conductor's admission gauges (requests running and waiting) from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    wanted = ("tidekv:num_requests_running", "tidekv:num_requests_waiting")
    return {s.name.removeprefix("tidekv:"): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name in wanted}


def drained_leaks(cluster: LocalCluster, timeout_s: float) -> dict[str, Any]:
    """Polls until every worker has freed every page and request (or ``timeout_s``); what is
    still held then, per worker, and the Conductor's admission gauges."""
    until = time.monotonic() + timeout_s
    while True:
        stats = worker_stats(cluster)
        held = {wid: {"pages_not_free": s.num_pages_total - s.num_free_pages, "live_requests": s.num_live_requests}
                for wid, s in stats.items()}
        clean = all(v["pages_not_free"] == 0 and v["live_requests"] == 0 for v in held.values())
        if clean or time.monotonic() > until:
            break
        time.sleep(0.2)
    gauges = conductor_gauges(cluster)
    num_expected = cluster.config.num_prefill + cluster.config.num_decode
    return {"workers": held, "conductor": gauges, "num_workers_answering": len(held),
            "none_leaked": clean and len(held) == num_expected and not any(gauges.values())}


def cut_to(requests: tuple[ReplayRequest, ...], remaining_s: float) -> list[ReplayRequest]:
    """The requests arriving within ``remaining_s`` of the window's start (at least one)."""
    return [r for i, r in enumerate(requests) if i == 0 or r.arrival_s < remaining_s]


def load(cluster: LocalCluster, config: SoakConfig, until: float) -> dict[str, Any]:
    """Replays windows back to back until ``until`` (monotonic); the outcome counts."""
    trace = read_trace(TRACE)
    num_in_trace = len(trace.requests)
    outcomes: Counter[str] = Counter()
    not_finished: list[dict[str, Any]] = []
    cursor, num_windows, num_tokens = config.first_index, 0, 0
    while (remaining_s := until - time.monotonic()) > 0:
        if cursor + config.window_requests > num_in_trace:
            cursor = 0
        requests = cut_to(apply_transform(trace, config.transform(cursor)).requests, remaining_s)
        result = run_live_replay(requests, cluster.endpoint, max_concurrency=config.max_concurrency,
                                 timeout_s=config.timeout_s, progress=False)
        num_windows += 1
        cursor += config.window_requests
        for r in result.records:
            outcomes[r.outcome] += 1
            num_tokens += r.num_output_tokens
            if r.outcome != FINISHED and len(not_finished) < 10:
                not_finished.append({"request_id": r.request_id, "outcome": r.outcome, "status": r.status,
                                     "error": r.error})
        if result.summary.run.get("interrupted"):
            log("interrupted: stopping the load")
            break
        log(f"window {num_windows}: {len(requests)} requests, {dict(outcomes)} so far, "
            f"{max(0.0, until - time.monotonic()):.0f} s of load left")
    return {"num_windows": num_windows, "num_requests": sum(outcomes.values()), "outcomes": dict(outcomes),
            "num_output_tokens": num_tokens, "not_finished_examples": not_finished}


def run_soak(config: SoakConfig) -> dict[str, Any]:
    """Starts a cluster, loads it for ``duration_s`` while sampling, drains, reports, stops it."""
    cluster_config = ClusterConfig(num_prefill=config.num_prefill, num_decode=config.num_decode,
                                   prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS)
    log(f"{config.duration_s:.0f} s of trace replay on {config.num_prefill} prefill + {config.num_decode} decode")
    with LocalCluster(cluster_config) as cluster:
        sampler = Sampler(cluster, config.sample_every_s)
        sampler.start()
        t0 = time.monotonic()
        try:
            requests = load(cluster, config, t0 + config.duration_s)
            load_s = time.monotonic() - t0
            leaks = drained_leaks(cluster, config.drain_timeout_s)
        finally:
            sampler.stop()
        exits = [{"name": e.name, "kind": e.kind, "exit": e.exit} for e in cluster.events]
        alive = {name: p.poll() is None for name, p in cluster.procs.items()}
    return {"config": asdict(config), "load_s": load_s, "requests": requests,
            "processes": {name: process_report(s) for name, s in sampler.procs.items()},
            "workers": {wid: worker_report(s) for wid, s in sampler.workers.items()},
            "leaks_at_end": leaks, "process_exits": exits, "alive_at_end": alive,
            "none_died": not exits and all(alive.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--sample-every-s", type=float, default=5.0)
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--window-requests", type=int, default=40)
    args = p.parse_args()
    if args.minutes <= 0 or args.sample_every_s <= 0:
        p.error("--minutes and --sample-every-s must be > 0")
    config = SoakConfig(duration_s=args.minutes * 60, sample_every_s=args.sample_every_s,
                        num_prefill=args.num_prefill, num_decode=args.num_decode, rate_scale=args.rate_scale,
                        window_requests=args.window_requests)
    print(json.dumps(run_soak(config), indent=2))


if __name__ == "__main__":
    main()
