"""Shared pieces of the global index tests: keys, a fake clock, value makers, and the
``harness`` fixture that runs a contract test on every backend."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from kvstore.blocks import Tier, chain_keys
from kvstore.index import (
    BlockEvent,
    GlobalIndex,
    WorkerInfo,
    WorkerRole,
)
from kvstore.index_memory import MemoryIndex
from kvstore.index_redis import RedisIndex, RedisIndexConfig

if TYPE_CHECKING:
    pass


KEYS = chain_keys(list(range(64)), block_size=8, model_fingerprint="test-model")  # 8 keys
LONG_TTL_S = 60.0
POLL_DEADLINE_S = 10.0
D, M, S = Tier.DEVICE, Tier.DRAM, Tier.SSD


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> None:
        self.now_s += dt_s


def info(worker_id: str, role: WorkerRole = WorkerRole.PREFILL) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"127.0.0.1:{5000 + len(worker_id)}", 128, 1 << 30, 1 << 32)


def stored(worker_id: str, i: int, tier: Tier = Tier.DRAM, snap: bool = False) -> BlockEvent:
    return BlockEvent.stored(worker_id, KEYS[i], tier, snap)


def ids(index: GlobalIndex) -> list[str]:
    return [w.worker_id for w, _ in index.workers()]


class Harness:
    """Makes indexes of one backend; ``expire`` ends a worker's lease the backend's way."""

    def __init__(self, kind: str, redis_url: str | None) -> None:
        self.kind = kind
        self.redis_url = redis_url
        self.namespace = f"t{uuid.uuid4().hex[:10]}"
        self.clock = FakeClock()
        self._opened: list[GlobalIndex] = []

    def make(self, ttl_s: float = LONG_TTL_S) -> GlobalIndex:
        if self.kind == "memory":
            index: GlobalIndex = MemoryIndex(ttl_s=ttl_s, clock=self.clock)
        else:
            assert self.redis_url is not None
            index = RedisIndex(self.redis_url, self.namespace, RedisIndexConfig(ttl_s=ttl_s))
        self._opened.append(index)
        return index

    def make_short_lived(self) -> GlobalIndex:
        # Redis leases are real time: 300 ms. Memory leases follow the fake clock.
        return self.make(ttl_s=0.3 if self.kind == "redis" else 5.0)

    def reopen(self, index: GlobalIndex) -> GlobalIndex:
        """A long-lease view of the same state (memory: the same object)."""
        return index if self.kind == "memory" else self.make()

    def expire(self, index: GlobalIndex, worker_id: str) -> None:
        if self.kind == "memory":
            self.clock.advance(5.0)
        else:
            deadline_s = time.monotonic() + POLL_DEADLINE_S
            while worker_id in ids(index) and time.monotonic() < deadline_s:
                time.sleep(0.05)
        assert worker_id not in ids(index)

    def close(self) -> None:
        for index in self._opened:
            index.close()




def check(index: GlobalIndex) -> None:
    if isinstance(index, MemoryIndex):
        index.check_integrity()
