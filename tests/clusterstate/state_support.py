"""Shared pieces of the cluster-state tests: keys, a fake clock, value makers, and the
``harness`` fixture that runs a contract test on a ``ClusterState`` changed directly and on
replicas of one changed through a log in a real Redis (``clusterstate.redis_log``)."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence

import redis

from clusterstate.log import EntryApplier, entry, record_of
from clusterstate.records import StoreKeys
from clusterstate.redis_log import RedisLog, RedisLogConfig
from clusterstate.state import ClusterState
from clusterstate.workers import WorkerInfo, WorkerLoad, WorkerRole
from kvstore.blocks import Tier, chain_keys
from kvstore.index import BlockEvent, MatchSnapshot
from proto import state_pb2 as spb
from proto.convert import block_event, load_to_proto

KEYS = chain_keys(list(range(64)), block_size=8, model_fingerprint="test-model")  # 8 keys
LONG_TTL_S = 60.0
D, M, S = Tier.DEVICE, Tier.DRAM, Tier.SSD
SECRET = b"s" * 64
KEYS_OF_STORE = StoreKeys.from_secret(SECRET)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> None:
        self.now_s += dt_s


def info(worker_id: str, role: WorkerRole = WorkerRole.PREFILL, instance: str = "i" * 16) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"127.0.0.1:{5000 + len(worker_id)}", 128, 1 << 30, 1 << 32,
                      instance_id=instance)


def stored(worker_id: str, i: int, tier: Tier = Tier.DRAM, snap: bool = False) -> BlockEvent:
    return BlockEvent.stored(worker_id, KEYS[i], tier, snap)


def ids(index) -> list[str]:
    return [w.worker_id for w, _ in index.workers()]


class Replica:
    """A ``ClusterState`` changed only through a ``RedisLog``, as a Conductor replica's is; the
    writes answer what the Conductor would have decided before publishing. The fake clock's
    jumps are no time without a Conductor: a replica starting after one renews no leases."""

    def __init__(self, url: str, namespace: str, clock: FakeClock, ttl_s: float) -> None:
        self.state = ClusterState(ttl_s=ttl_s, clock=clock)
        self.log = RedisLog(lambda: redis.Redis.from_url(url, socket_timeout=2), EntryApplier(self.state,
                            KEYS_OF_STORE), KEYS_OF_STORE, f"r-{uuid.uuid4().hex[:6]}",
                            RedisLogConfig(namespace=namespace, read_block_ms=50, quiet_s=math.inf))
        self.log.start()
        until = time.monotonic() + 10
        while not self.log.ready:
            assert time.monotonic() < until, "the replica did not catch up"
            time.sleep(0.01)

    def _publish(self, **change: object) -> None:
        self.log.publish(entry(self.log.replica_id, self.state.now(), **change))

    def register(self, worker: WorkerInfo) -> bool:
        old = self.state.worker(worker.worker_id)
        self._publish(registered=record_of(worker, KEYS_OF_STORE))
        return old is None or old.instance_id != worker.instance_id

    def heartbeat(self, worker_id: str, load: WorkerLoad) -> bool:
        if self.state.worker(worker_id) is None:
            return False
        self._publish(heartbeat=spb.HeartbeatEntry(worker_id=worker_id, load=load_to_proto(load)))
        return True

    def apply(self, events: Sequence[BlockEvent]) -> int:
        alive = {w for w, _ in ((i.worker_id, None) for i, _ in self.state.workers())}
        wire = [e for e in events if e.worker_id in alive]
        for worker_id in sorted({e.worker_id for e in wire}):
            mine = [block_event(e.key, e.tier, e.has_snapshot) for e in wire if e.worker_id == worker_id]
            self._publish(blocks=spb.BlocksEntry(worker_id=worker_id, events=mine))
        return len(wire)

    def remove(self, worker_id: str) -> bool:
        known = worker_id in ids(self.state)
        self._publish(removed=spb.RemovedEntry(worker_id=worker_id))
        return known

    def match(self, keys) -> MatchSnapshot:
        return self.state.match(keys)

    def workers(self):
        return self.state.workers()

    def reap_expired(self):
        return self.state.reap_expired()

    def check_integrity(self) -> None:
        self.state.check_integrity()

    def close(self) -> None:
        self.log.close()


class Harness:
    """Makes cluster states of one kind: ``memory`` (changed directly) or ``redis`` (replicas
    over one log); ``reopen`` gives another view of the same state (redis: a new replica)."""

    def __init__(self, kind: str, redis_url: str | None) -> None:
        self.kind = kind
        self.redis_url = redis_url
        self.namespace = f"t{uuid.uuid4().hex[:10]}"
        self.clock = FakeClock()
        self._opened: list[Replica] = []

    def make(self, ttl_s: float = LONG_TTL_S):
        if self.kind == "memory":
            return ClusterState(ttl_s=ttl_s, clock=self.clock)
        assert self.redis_url is not None
        replica = Replica(self.redis_url, self.namespace, self.clock, ttl_s)
        self._opened.append(replica)
        return replica

    def make_short_lived(self):
        return self.make(ttl_s=5.0)

    def reopen(self, index):
        """Another view of the same state (memory: the same object; redis: a new replica,
        which catches up from the log)."""
        return index if self.kind == "memory" else self.make(index.state.ttl_s)

    def expire(self, index, worker_id: str) -> None:
        self.clock.advance(5.0)
        assert worker_id not in ids(index)

    def close(self) -> None:
        for replica in self._opened:
            replica.close()


def check(index) -> None:
    index.check_integrity()
