"""Global index: contract tests over both backends, Redis-specific tests against a real
redis-server (sharing, restart, namespaces, one round trip, outage and fallback), and exact
mechanism tests of the memory backend with an injected clock."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
import redis

from kvstore.blocks import Tier, chain_keys
from kvstore.index import (
    BlockEvent,
    GlobalIndex,
    IndexUnavailable,
    MatchSnapshot,
    WorkerInfo,
    WorkerLoad,
    WorkerMatch,
    WorkerRole,
)
from kvstore.index_fallback import FallbackIndex
from kvstore.index_memory import MemoryIndex
from kvstore.index_redis import RedisIndex, RedisIndexConfig

if TYPE_CHECKING:
    from tests.kvstore.conftest import RedisServer

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


@pytest.fixture(params=["memory", "redis"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    h = Harness(request.param, url)
    try:
        yield h
    finally:
        h.close()


def check(index: GlobalIndex) -> None:
    if isinstance(index, MemoryIndex):
        index.check_integrity()


# --- contract: every backend -------------------------------------------------------------


def test_apply_and_match_basics(harness: Harness) -> None:
    index = harness.make()
    assert index.register(info("w1")) is True
    assert index.register(info("w2", WorkerRole.DECODE)) is True
    events = [stored("w1", 0), stored("w1", 1), stored("w1", 2, snap=True), stored("w2", 0)]
    assert index.apply(events) == 4

    snapshot = index.match(KEYS[:4])
    assert snapshot == MatchSnapshot(4, (WorkerMatch("w1", 3, 3, (M, M, M)), WorkerMatch("w2", 1, 0, (M,))))
    assert snapshot.best_usable == WorkerMatch("w1", 3, 3, (M, M, M))
    assert snapshot.get("nobody") is None
    assert index.match([]) == MatchSnapshot(0, (WorkerMatch("w1", 0, 0, ()), WorkerMatch("w2", 0, 0, ())))
    check(index)


def test_hole_stops_the_prefix(harness: Harness) -> None:
    index = harness.make()
    index.register(info("w1"))
    index.apply([stored("w1", i, snap=True) for i in (0, 1, 3, 4)])
    assert index.match(KEYS[:5]).get("w1") == WorkerMatch("w1", 2, 2, (M, M))
    index.apply([stored("w1", 2)])
    assert index.match(KEYS[:5]).get("w1") == WorkerMatch("w1", 5, 5, (M,) * 5)
    # A missing first key means no match at all, whatever follows.
    assert index.match(KEYS[5:]).get("w1") == WorkerMatch("w1", 0, 0, ())


def test_hybrid_hit_rule_usable_stops_at_last_snapshot(harness: Harness) -> None:
    index = harness.make()
    index.register(info("w1"))
    index.register(info("w2"))
    index.apply([stored("w1", i, snap=(i == 1)) for i in range(4)])
    # w2's only snapshot (block 3) lies beyond a hole at block 2: unreachable.
    index.apply([stored("w2", 0), stored("w2", 1), stored("w2", 3, snap=True)])
    snapshot = index.match(KEYS[:4])
    assert snapshot.get("w1") == WorkerMatch("w1", 4, 2, (M,) * 4)
    assert snapshot.get("w2") == WorkerMatch("w2", 2, 0, (M, M))
    assert snapshot.best_usable == snapshot.get("w1")


def test_tier_reported_and_moved_by_events(harness: Harness) -> None:
    index = harness.make()
    index.register(info("w1"))
    index.apply([stored("w1", 0, D), stored("w1", 1, M, snap=True), stored("w1", 2, S)])
    match = index.match(KEYS[:3]).get("w1")
    assert match == WorkerMatch("w1", 3, 2, (D, M, S))
    assert match is not None and match.slowest_usable_tier == M
    # A later event moves the block (demotion) and can change its snapshot flag.
    index.apply([stored("w1", 0, S), stored("w1", 2, S, snap=True)])
    match = index.match(KEYS[:3]).get("w1")
    assert match == WorkerMatch("w1", 3, 3, (S, M, S))
    assert match is not None and match.slowest_usable_tier == S
    check(index)


def test_removal_of_blocks_and_workers(harness: Harness) -> None:
    index = harness.make()
    index.register(info("w1"))
    index.register(info("w2"))
    index.apply([stored(w, i, snap=True) for w in ("w1", "w2") for i in range(3)])
    index.apply([BlockEvent.removed("w1", KEYS[1]), BlockEvent.removed("w1", KEYS[7])])
    assert index.match(KEYS[:3]).get("w1") == WorkerMatch("w1", 1, 1, (M,))
    assert index.remove("w2") is True
    assert index.remove("w2") is False
    assert ids(index) == ["w1"]
    assert index.match(KEYS[:3]).get("w2") is None
    # A removed worker's blocks do not come back with a new incarnation.
    index.register(info("w2"))
    assert index.match(KEYS[:3]).get("w2") == WorkerMatch("w2", 0, 0, ())
    check(index)


def test_events_of_unknown_workers_are_ignored(harness: Harness) -> None:
    index = harness.make()
    index.register(info("w1"))
    assert index.apply([stored("ghost", 0), stored("w1", 0), BlockEvent.removed("ghost", KEYS[0])]) == 1
    assert [m.worker_id for m in index.match(KEYS[:1]).matches] == ["w1"]
    check(index)


def test_registry_heartbeat_and_loads(harness: Harness) -> None:
    index = harness.make()
    w1, w2 = info("w1"), info("w2", WorkerRole.DECODE)
    index.register(w2)
    index.register(w1)
    assert index.workers() == [(w1, WorkerLoad.initial(w1)), (w2, WorkerLoad.initial(w2))]
    load = WorkerLoad(queue_len=3, num_running_requests=2, num_free_pages=7, free_dram_bytes=99,
                      num_tokens_in_flight=512, timestamp_s=1.7e9 + 0.25)  # fmt: skip
    assert index.heartbeat("w1", load) is True
    assert index.heartbeat("nobody", load) is False
    assert index.workers()[0] == (w1, load)
    # Registering an alive worker again refreshes its info but keeps load and blocks.
    index.apply([stored("w1", 0, snap=True)])
    moved = WorkerInfo("w1", WorkerRole.PREFILL, "10.0.0.1:1", 64, 1, 2)
    assert index.register(moved) is False
    assert index.workers()[0] == (moved, load)
    assert index.match(KEYS[:1]).get("w1") == WorkerMatch("w1", 1, 1, (M,))


def test_expiry_hides_worker_and_blocks_then_reregister(harness: Harness) -> None:
    index = harness.make_short_lived()
    index.register(info("w1"))
    index.apply([stored("w1", i, snap=True) for i in range(3)])
    assert index.match(KEYS[:3]).get("w1") == WorkerMatch("w1", 3, 3, (M,) * 3)

    harness.expire(index, "w1")
    assert index.match(KEYS[:3]).matches == ()
    assert index.heartbeat("w1", WorkerLoad()) is False
    assert index.apply([stored("w1", 3)]) == 0

    index = harness.reopen(index)
    assert index.register(info("w1")) is True  # a new incarnation: stale blocks are dropped
    assert index.match(KEYS[:3]).get("w1") == WorkerMatch("w1", 0, 0, ())
    assert index.apply([stored("w1", 0, D, snap=True)]) == 1
    assert index.match(KEYS[:3]).get("w1") == WorkerMatch("w1", 1, 1, (D,))
    check(index)


def test_reap_expired_purges_entries(harness: Harness) -> None:
    index = harness.make_short_lived()
    index.register(info("w1"))
    index.apply([stored("w1", i) for i in range(3)])
    harness.expire(index, "w1")
    assert index.reap_expired() == ("w1",)
    assert index.reap_expired() == ()
    if isinstance(index, MemoryIndex):
        index.check_integrity()
        assert index.stored_events() == []
    else:
        client = redis.Redis.from_url(harness.redis_url or "")
        assert list(client.scan_iter(f"{harness.namespace}:*")) == []
        client.close()


def test_invalid_inputs_raise_value_error(harness: Harness) -> None:
    index = harness.make()
    with pytest.raises(ValueError, match="16 bytes"):
        index.match([b"short"])
    with pytest.raises(ValueError, match="16 bytes"):
        BlockEvent.stored("w1", b"x" * 15, Tier.DRAM)
    with pytest.raises(ValueError, match="tier"):
        BlockEvent("w1", KEYS[0], None, False, BlockEvent.stored("w", KEYS[0], D).kind)
    with pytest.raises(ValueError, match="num_pages_total"):
        WorkerInfo("w1", WorkerRole.DECODE, "a:1", -1, 0, 0)
    with pytest.raises(ValueError, match="queue_len"):
        WorkerLoad(queue_len=-1)


# --- Redis: sharing, restart, isolation, round trips, outages ----------------------------


def test_two_conductors_on_one_namespace_share_state(redis_url: str) -> None:
    namespace = f"t{uuid.uuid4().hex[:10]}"
    first, second = RedisIndex(redis_url, namespace), RedisIndex(redis_url, namespace)
    first.register(info("w1"))
    second.apply([stored("w1", 0, D), stored("w1", 1, snap=True)])
    second.heartbeat("w1", WorkerLoad(queue_len=5))
    assert first.match(KEYS[:2]) == second.match(KEYS[:2])
    assert first.match(KEYS[:2]).get("w1") == WorkerMatch("w1", 2, 2, (D, M))
    assert first.workers()[0][1] == WorkerLoad(queue_len=5)
    first.close()
    second.close()


def test_restarted_conductor_keeps_the_index(redis_url: str) -> None:
    namespace = f"t{uuid.uuid4().hex[:10]}"
    before = RedisIndex(redis_url, namespace)
    before.register(info("w1"))
    before.apply([stored("w1", i, snap=True) for i in range(4)])
    expected = before.match(KEYS)
    before.close()
    after = RedisIndex(redis_url, namespace)
    assert after.match(KEYS) == expected
    assert ids(after) == ["w1"]
    after.close()


def test_namespaces_isolate(redis_url: str) -> None:
    a = RedisIndex(redis_url, f"a{uuid.uuid4().hex[:10]}")
    b = RedisIndex(redis_url, f"b{uuid.uuid4().hex[:10]}")
    a.register(info("w1"))
    a.apply([stored("w1", 0, snap=True)])
    assert b.workers() == []
    assert b.match(KEYS[:1]).matches == ()
    b.register(info("w1"))
    assert b.match(KEYS[:1]).get("w1") == WorkerMatch("w1", 0, 0, ())
    assert a.match(KEYS[:1]).get("w1") == WorkerMatch("w1", 1, 1, (M,))
    a.close()
    b.close()


def test_match_of_1000_keys_is_one_round_trip(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = chain_keys(list(range(1000)), block_size=1, model_fingerprint="rt")
    index = RedisIndex(redis_url, f"t{uuid.uuid4().hex[:10]}")
    for worker_id in ("w1", "w2", "w3"):
        index.register(info(worker_id))
    index.apply([BlockEvent.stored("w1", k, Tier.DRAM, i % 100 == 99) for i, k in enumerate(keys)])
    index.apply([BlockEvent.stored("w2", k, Tier.SSD) for k in keys[:10]])
    index.match(keys[:1])  # loads the script, as the first match after a server start does
    admin = redis.Redis.from_url(redis_url)
    before = admin.info("commandstats")

    num_sent, num_read = [0], [0]
    send, read = redis.connection.Connection.send_packed_command, redis.connection.Connection.read_response

    def counting_send(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        num_sent[0] += 1
        return send(self, *args, **kwargs)

    def counting_read(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        num_read[0] += 1
        return read(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting_send)
    monkeypatch.setattr(redis.connection.Connection, "read_response", counting_read)
    snapshot = index.match(keys)
    monkeypatch.undo()

    after = admin.info("commandstats")
    admin.close()
    index.close()
    assert (num_sent[0], num_read[0]) == (1, 1)
    assert after["cmdstat_evalsha"]["calls"] - before["cmdstat_evalsha"]["calls"] == 1
    assert snapshot.get("w1") == WorkerMatch("w1", 1000, 1000, (M,) * 1000)
    assert snapshot.get("w2") == WorkerMatch("w2", 10, 0, (S,) * 10)
    assert snapshot.get("w3") == WorkerMatch("w3", 0, 0, ())


def unreachable_url() -> str:
    """A URL nothing listens on: a port the kernel just handed out and that was closed again."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def test_unreachable_redis_raises_index_unavailable_after_bounded_backoff() -> None:
    url = unreachable_url()
    delays_s: list[float] = []
    config = RedisIndexConfig(num_retries=4, backoff_base_s=0.01, backoff_cap_s=0.03, retry_budget_s=5.0)
    index = RedisIndex(url, "t", config, sleep=delays_s.append)  # constructing does not connect
    calls: list[Callable[[], object]] = [
        lambda: index.match(KEYS),
        lambda: index.apply([stored("w1", 0)]),
        lambda: index.register(info("w1")),
        lambda: index.heartbeat("w1", WorkerLoad()),
        index.workers,
        lambda: index.remove("w1"),
        index.reap_expired,
    ]
    for call in calls:
        delays_s.clear()
        with pytest.raises(IndexUnavailable, match=url) as excinfo:
            call()
        assert isinstance(excinfo.value.cause, redis.exceptions.ConnectionError)
        assert delays_s == [0.01, 0.02, 0.03, 0.03]
    index.close()


def test_retry_budget_bounds_the_number_of_attempts() -> None:
    delays_s: list[float] = []
    config = RedisIndexConfig(num_retries=100, backoff_base_s=0.01, backoff_cap_s=0.02, retry_budget_s=0.2)
    index = RedisIndex(unreachable_url(), "t", config, sleep=lambda s: (delays_s.append(s), time.sleep(s)))
    with pytest.raises(IndexUnavailable):
        index.workers()
    assert 0 < len(delays_s) < 100
    index.close()


def test_fallback_answers_locally_through_an_outage_and_recovers(
    redis_server_factory: Callable[[], RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_server_factory()
    clock = FakeClock()
    config = RedisIndexConfig(ttl_s=LONG_TTL_S, retry_budget_s=0.2)
    index = FallbackIndex(
        RedisIndex(server.url, "fb", config),
        MemoryIndex(LONG_TTL_S, clock),
        retry_interval_s=5.0,
        clock=clock,
    )
    index.register(info("w1"))
    index.apply([stored("w1", 0), stored("w1", 1, snap=True)])
    assert index.match(KEYS[:4]).get("w1") == WorkerMatch("w1", 2, 2, (M, M))
    assert index.using_primary

    server.kill()
    with caplog.at_level(logging.WARNING, logger="kvstore.index_redis"):
        index.apply([stored("w1", 2, D, snap=True)])
        assert index.match(KEYS[:4]).get("w1") == WorkerMatch("w1", 3, 3, (M, M, D))
        assert index.heartbeat("w1", WorkerLoad(queue_len=4)) is True
        assert index.workers() == [(info("w1"), WorkerLoad(queue_len=4))]
    assert not index.using_primary
    assert [r.levelno for r in caplog.records] == [logging.WARNING]  # once per outage
    assert server.url in caplog.records[0].getMessage()

    server.start()  # same port, empty: the process lost everything
    assert index.match(KEYS[:4]).get("w1") == WorkerMatch("w1", 3, 3, (M, M, D))
    assert not index.using_primary  # the retry interval has not passed yet
    clock.advance(5.0)
    assert index.match(KEYS[:4]).get("w1") == WorkerMatch("w1", 3, 3, (M, M, D))
    assert index.using_primary
    fresh = RedisIndex(server.url, "fb")  # Redis itself got the local state back
    assert fresh.match(KEYS[:4]).get("w1") == WorkerMatch("w1", 3, 3, (M, M, D))
    assert fresh.workers() == [(info("w1"), WorkerLoad(queue_len=4))]
    index.apply([BlockEvent.removed("w1", KEYS[1])])
    assert fresh.match(KEYS[:4]).get("w1") == WorkerMatch("w1", 1, 0, (M,))

    caplog.clear()
    server.kill()  # a second outage warns once more
    with caplog.at_level(logging.WARNING, logger="kvstore.index_redis"):
        assert index.match(KEYS[:4]).get("w1") == WorkerMatch("w1", 1, 0, (M,))
        index.match(KEYS[:4])
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    fresh.close()
    index.close()


def test_fallback_with_redis_down_from_the_start() -> None:
    clock = FakeClock()
    primary = RedisIndex(unreachable_url(), "t", RedisIndexConfig(retry_budget_s=0.05))
    index = FallbackIndex(primary, MemoryIndex(LONG_TTL_S, clock), retry_interval_s=1.0, clock=clock)
    assert index.register(info("w1")) is True
    assert index.apply([stored("w1", 0, snap=True)]) == 1
    assert index.match(KEYS[:2]).get("w1") == WorkerMatch("w1", 1, 1, (M,))
    clock.advance(1.0)  # a due retry fails again and keeps answering locally
    assert ids(index) == ["w1"]
    assert not index.using_primary
    index.close()


# --- memory mechanism: exact lease arithmetic, integrity, threads ------------------------


def test_memory_lease_expires_exactly_at_ttl_and_heartbeats_renew() -> None:
    clock = FakeClock()
    index = MemoryIndex(ttl_s=2.0, clock=clock)
    index.register(info("w1"))
    index.apply([stored("w1", 0, snap=True)])
    clock.advance(1.999)
    assert ids(index) == ["w1"]
    assert index.heartbeat("w1", WorkerLoad()) is True
    clock.advance(1.999)
    assert index.match(KEYS[:1]).get("w1") is not None
    clock.advance(0.001)  # exactly ttl_s after the last heartbeat: gone
    assert ids(index) == []
    assert index.match(KEYS[:1]).matches == ()
    assert index.try_hold("w1", KEYS[0]) is None
    index.check_integrity()


def test_memory_writes_reap_expired_workers() -> None:
    clock = FakeClock()
    index = MemoryIndex(ttl_s=1.0, clock=clock)
    index.register(info("w1"))
    index.apply([stored("w1", i) for i in range(4)])
    clock.advance(1.0)
    index.register(info("w2"))  # any write reaps
    assert index.reap_expired() == ()
    assert index.stored_events() == []
    index.check_integrity()


def test_memory_stored_events_replay_into_an_equal_index() -> None:
    clock = FakeClock()
    source, copy = MemoryIndex(clock=clock), MemoryIndex(clock=clock)
    for index in (source, copy):
        index.register(info("w1"))
        index.register(info("w2"))
    source.apply([stored("w1", i, Tier(i % 3), snap=i % 2 == 1) for i in range(6)] + [stored("w2", 0, D)])
    copy.apply(source.stored_events())
    assert copy.match(KEYS) == source.match(KEYS)
    assert sorted(copy.stored_events(), key=repr) == sorted(source.stored_events(), key=repr)


def test_memory_check_integrity_detects_a_broken_mirror() -> None:
    index = MemoryIndex(clock=FakeClock())
    index.register(info("w1"))
    index.apply([stored("w1", 0)])
    index.check_integrity()
    index._worker_blocks["w1"].clear()  # break the invariant behind the index's back
    with pytest.raises(AssertionError):
        index.check_integrity()


def test_memory_index_is_consistent_under_concurrent_threads() -> None:
    index = MemoryIndex(clock=FakeClock())
    workers = [f"w{i}" for i in range(4)]
    for worker_id in workers:
        index.register(info(worker_id))

    def churn(worker_id: str) -> None:
        for round_ in range(200):
            i = round_ % len(KEYS)
            index.apply([stored(worker_id, i, snap=True)])
            index.match(KEYS)
            if round_ % 3 == 0:
                index.apply([BlockEvent.removed(worker_id, KEYS[i])])

    threads = [threading.Thread(target=churn, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    index.check_integrity()
    assert {m.worker_id for m in index.match(KEYS).matches} == set(workers)
