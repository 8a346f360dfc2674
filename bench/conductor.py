"""How many routing decisions per second the Conductor core makes: keys given, snapshot plus
policy plus index match for a 1,000-block prompt on 8 prefill + 8 decode workers, with the
memory index and with the Redis index (a real ``redis-server`` on 127.0.0.1), for each policy.
Prints one JSON object. Goal: at least 2,000 decisions/s with the memory index.

Every worker holds a prefix of the prompt of a different depth, and 16 requests are in
flight in the pending overlay, so the snapshot has real work to merge.

Usage: python -m bench.conductor [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time

from bench.common import summary
from conductor.clock import ManualClock
from conductor.config import SLO, SLOTable
from conductor.core import ConductorCore, RequestFacts
from conductor.routing import PolicyContext, RouteDecision, make_policy, policy_names
from conductor.snapshot import RegistryEntry
from costmodel.builtin import tiny_cpu_estimate
from kvstore.blocks import Tier, chain_keys
from kvstore.index import BlockEvent, GlobalIndex, WorkerInfo, WorkerLoad, WorkerRole
from kvstore.index_memory import MemoryIndex

BLOCK, NUM_BLOCKS, NUM_WORKERS = 16, 1000, 8


class IndexCluster:
    """A ClusterView over a real index; the registry is fixed (no heartbeats during the run)."""

    model_fingerprint = "bench"
    block_size = BLOCK

    def __init__(self, index: GlobalIndex):
        self.index = index
        self.entries = tuple(
            RegistryEntry(f"{role}-{i}", WorkerRole(role), f"127.0.0.1:{6000 + i}", f"tcp://127.0.0.1:{7000 + i}",
                          WorkerLoad(num_free_pages=100_000))
            for role in ("prefill", "decode") for i in range(NUM_WORKERS))
        for e in self.entries:
            index.register(WorkerInfo(e.worker_id, e.role, e.rpc_address, 100_000, 0, 0))

    def registry_view(self, wall_now_s: float):
        return self.entries

    def match(self, keys):
        return self.index.match(keys) if keys else None


def seed(index: GlobalIndex, keys: list[bytes]) -> None:
    """Prefill worker i holds the first (i + 1) / 8 of the prompt, a snapshot every 4 blocks."""
    for i in range(NUM_WORKERS):
        depth = NUM_BLOCKS * (i + 1) // NUM_WORKERS
        index.apply([BlockEvent.stored(f"prefill-{i}", k, Tier.DRAM, (j + 1) % 4 == 0)
                     for j, k in enumerate(keys[:depth])])


def decisions_per_s(index: GlobalIndex, policy: str, keys: tuple[bytes, ...], seconds: float) -> dict:
    cluster = IndexCluster(index)
    seed(index, list(keys))
    core = ConductorCore(cluster, make_policy(policy, PolicyContext(costs=tiny_cpu_estimate())),
                         SLOTable(SLO(1e9, 1e9)), ManualClock())
    for i in range(16):  # requests in flight: the overlay has work to merge
        core.route(RequestFacts(f"inflight-{i}", i, (), 8, "", block_keys=keys, num_prompt_tokens=len(keys) * BLOCK))
    samples, n, seq = [], 0, 16
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        t0 = time.perf_counter()
        facts = RequestFacts(f"r{seq}", seq, (), 8, "", block_keys=keys, num_prompt_tokens=len(keys) * BLOCK + 1)
        out = core.route(facts)
        core.pending.finish(facts.request_id, 0.0)
        samples.append(time.perf_counter() - t0)
        assert isinstance(out.outcome, RouteDecision), out.outcome
        n, seq = n + 1, seq + 1
    s = summary(samples)
    return {"decisions_per_s": n / sum(samples), "median_us": s["median_s"] * 1e6, "p90_us": s["p90_s"] * 1e6}


def redis_index(port: int, tmp: str) -> tuple[subprocess.Popen, GlobalIndex]:
    from kvstore.index_redis import RedisIndex, RedisIndexConfig

    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp],
                            stdout=subprocess.DEVNULL)
    for _ in range(100):
        try:
            index = RedisIndex(f"redis://127.0.0.1:{port}", config=RedisIndexConfig(ttl_s=1e6))
            index.workers()
            return proc, index
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    seconds = 0.5 if args.quick else 2.0
    keys = tuple(chain_keys([(i * 31) % 250 + 1 for i in range(NUM_BLOCKS * BLOCK)], BLOCK, "bench"))
    out: dict = {"prompt_blocks": NUM_BLOCKS, "workers": f"{NUM_WORKERS} prefill + {NUM_WORKERS} decode",
                 "goal_memory_decisions_per_s": 2000, "memory": {}, "redis": {}}
    for policy in policy_names():
        out["memory"][policy] = decisions_per_s(MemoryIndex(ttl_s=1e9), policy, keys, seconds)
        print(f"[conductor] memory {policy}: {out['memory'][policy]['decisions_per_s']:.0f}/s", file=sys.stderr)
    if shutil.which("redis-server"):
        from deploy.local import free_port

        with tempfile.TemporaryDirectory() as tmp:
            proc, index = redis_index(free_port(), tmp)
            try:
                for policy in ("mooncake", "cache_aware"):
                    out["redis"][policy] = decisions_per_s(index, policy, keys, seconds)
            finally:
                index.close()
                proc.terminate()
                proc.wait(timeout=10)
    else:
        out["redis"] = {"available": False, "reason": "redis-server not installed"}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
