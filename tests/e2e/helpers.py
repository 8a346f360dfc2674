"""Shared helpers for the end-to-end tests."""

import time
from concurrent.futures import ThreadPoolExecutor

from conductor.client import Client, Completion
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.auth import worker_principal


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 131 + salt * 7919) % 250 + 1 for i in range(n)]


def run_all(endpoint: str, requests: list, max_workers: int = 8) -> list[Completion]:
    """Sends every request concurrently (they decode in one batch); results in order."""
    client = Client(endpoint)
    try:
        with ThreadPoolExecutor(max_workers) as pool:
            return list(pool.map(client.generate, requests))
    finally:
        client.close()


def worker_stats(cluster, only: str | None = None) -> dict[str, ipb.WorkerStats]:
    """Every registered worker's Stats (``only``: that worker's alone)."""
    out = {}
    for info in cluster.workers().workers:
        if only is not None and info.worker_id != only:
            continue
        ch = cluster.channel(info.rpc_address, worker_principal(info.worker_id))
        stub = igrpc.PrefillStub(ch) if info.role == ipb.WORKER_ROLE_PREFILL else igrpc.DecodeStub(ch)
        out[info.worker_id] = stub.Stats(ipb.StatsRequest(), timeout=5)
        ch.close()
    return out


def wait_all_freed(cluster, timeout_s: float = 30.0) -> dict[str, ipb.WorkerStats]:
    """Polls until every worker holds no request cache; returns the last stats either way."""
    until = time.monotonic() + timeout_s
    while True:
        stats = worker_stats(cluster)
        if all(s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total for s in stats.values()):
            return stats
        if time.monotonic() > until:
            return stats
        time.sleep(0.1)
