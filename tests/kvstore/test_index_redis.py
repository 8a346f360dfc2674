"""Global index in a real redis-server: sharing between Conductors, restart, namespaces, one
round trip per match, outages with the local fallback and recovery."""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import redis

from kvstore.blocks import Tier, chain_keys
from kvstore.index import (
    BlockEvent,
    IndexUnavailable,
    PrefillJobLoad,
    WorkerLoad,
    WorkerMatch,
)
from kvstore.index_fallback import FallbackIndex
from kvstore.index_memory import MemoryIndex
from kvstore.index_redis import RedisIndex, RedisIndexConfig

if TYPE_CHECKING:
    from tests.redis_fixtures import RedisServer

from tests.kvstore.index_support import (
    KEYS,
    LONG_TTL_S,
    D,
    FakeClock,
    M,
    S,
    ids,
    info,
    stored,
)

# --- Redis: sharing, restart, isolation, round trips, outages ----------------------------


def test_two_conductors_on_one_namespace_share_state(redis_url: str) -> None:
    namespace = f"t{uuid.uuid4().hex[:10]}"
    first, second = RedisIndex(redis_url, namespace), RedisIndex(redis_url, namespace)
    first.register(info("w1"))
    second.apply([stored("w1", 0, D), stored("w1", 1, snap=True)])
    second.heartbeat("w1", WorkerLoad(num_queued=5, prefill_jobs=(PrefillJobLoad("r", 9, 3, 0.25),)))
    assert first.match(KEYS[:2]) == second.match(KEYS[:2])
    assert first.match(KEYS[:2]).get("w1") == WorkerMatch("w1", 2, 2, (D, M))
    assert first.workers()[0][1] == WorkerLoad(num_queued=5, prefill_jobs=(PrefillJobLoad("r", 9, 3, 0.25),))
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
        assert index.heartbeat("w1", WorkerLoad(num_queued=4, request_ids=("a", "b"))) is True
        assert index.workers() == [(info("w1"), WorkerLoad(num_queued=4, request_ids=("a", "b")))]
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
    assert fresh.workers() == [(info("w1"), WorkerLoad(num_queued=4, request_ids=("a", "b")))]
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
