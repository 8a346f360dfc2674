"""Global index in a real redis-server: sharing between Conductors, restart, namespaces, one
round trip per match, bounded calls to a dead or hung server, restart detection, and the
local fallback through outages with its resync into Redis on recovery."""

from __future__ import annotations

import logging
import socket
import threading
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
    WorkerInfo,
    WorkerLoad,
    WorkerMatch,
    WorkerRole,
)
from kvstore.index_fallback import FallbackIndex, Mode, ResyncCounts
from kvstore.index_memory import MemoryIndex
from kvstore.index_redis import RedisIndex, RedisIndexConfig

if TYPE_CHECKING:
    from tests.redis_fixtures import RedisServer

from tests.kvstore.index_support import (
    KEYS,
    LONG_TTL_S,
    POLL_DEADLINE_S,
    D,
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


def test_hung_redis_raises_index_unavailable_on_every_call(
    redis_server_factory: Callable[[], RedisServer],
) -> None:
    """SIGSTOP: connections are accepted and nothing answers; every call ends by a timeout."""
    server = redis_server_factory()
    config = RedisIndexConfig(connect_timeout_s=0.1, socket_timeout_s=0.1, retry_budget_s=0.05)
    index = RedisIndex(server.url, "t", config)
    index.register(info("w1"))  # a pooled connection exists: the first call sends on it
    server.pause()
    try:
        for call in (lambda: index.match(KEYS), index.workers, lambda: index.heartbeat("w1", WorkerLoad())):
            with pytest.raises(IndexUnavailable, match=server.url) as excinfo:
                call()
            assert isinstance(excinfo.value.cause, redis.exceptions.TimeoutError)
    finally:
        server.resume()
    assert ids(index) == ["w1"]  # the same server, state intact, answering again
    index.close()


def test_server_epoch_counts_lost_scripts_not_the_first_load(redis_server_factory: Callable[[], RedisServer]) -> None:
    server = redis_server_factory()
    index = RedisIndex(server.url, "t", RedisIndexConfig(ttl_s=LONG_TTL_S))
    index.register(info("w1"))
    assert index.server_epoch == 0  # loading the scripts for the first call is not a loss
    admin = redis.Redis.from_url(server.url)
    admin.script_flush()
    assert ids(index) == ["w1"]  # reloaded transparently
    assert index.server_epoch == 1
    server.kill()
    server.start()  # empty, and without the scripts
    assert ids(index) == []
    assert index.server_epoch == 2
    admin.close()
    index.close()


def test_reset_worker_drops_what_redis_held(redis_url: str) -> None:
    index = RedisIndex(redis_url, f"t{uuid.uuid4().hex[:10]}", RedisIndexConfig(ttl_s=LONG_TTL_S))
    index.register(info("w1"))
    index.apply([stored("w1", 0, snap=True), stored("w1", 1, snap=True)])
    index.heartbeat("w1", WorkerLoad(num_queued=7))
    index.reset_worker(info("w1"), WorkerLoad(num_running=2))
    assert index.match(KEYS[:2]).get("w1") == WorkerMatch("w1", 0, 0, ())
    assert index.workers() == [(info("w1"), WorkerLoad(num_running=2))]
    index.reset_worker(info("w2"), WorkerLoad())  # an id Redis never saw becomes alive
    assert ids(index) == ["w1", "w2"]
    index.close()


def fallback(url: str, *, background: bool = False, interval_s: float = 5.0) -> FallbackIndex:
    config = RedisIndexConfig(ttl_s=LONG_TTL_S, retry_budget_s=0.2)
    return FallbackIndex(
        RedisIndex(url, "fb", config), MemoryIndex(LONG_TTL_S), interval_s, recover_in_background=background
    )


def fresh_view(url: str) -> RedisIndex:
    """A second client of the namespace: what Redis itself holds (and other Conductors see)."""
    return RedisIndex(url, "fb", RedisIndexConfig(ttl_s=LONG_TTL_S))


def test_fallback_answers_locally_through_an_outage_and_resyncs(
    redis_server_factory: Callable[[], RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_server_factory()
    index = fallback(server.url)
    index.register(info("w1"))
    index.apply([stored("w1", 0), stored("w1", 1, snap=True)])
    assert index.match(KEYS[:4]).get("w1") == WorkerMatch("w1", 2, 2, (M, M))
    assert index.mode is Mode.UP

    server.kill()
    with caplog.at_level(logging.INFO, logger="kvstore.index_fallback"):
        index.apply([stored("w1", 2, D, snap=True)])  # meets the outage
        assert index.match(KEYS[:4]).get("w1") == WorkerMatch("w1", 3, 3, (M, M, D))
        assert index.heartbeat("w1", WorkerLoad(num_queued=4, request_ids=("a", "b"))) is True
        index.register(info("w2", WorkerRole.DECODE))
        assert index.workers() == [
            (info("w1"), WorkerLoad(num_queued=4, request_ids=("a", "b"))),
            (info("w2", WorkerRole.DECODE), WorkerLoad.initial(info("w2"))),
        ]
        assert index.try_resync() is False  # still down
    assert index.mode is Mode.DOWN
    assert [r.levelno for r in caplog.records] == [logging.WARNING]  # once per outage
    assert server.url in caplog.records[0].getMessage()

    caplog.clear()
    server.start()  # same port, empty: the process lost everything
    assert index.mode is Mode.DOWN  # nothing on the request path probes Redis
    with caplog.at_level(logging.INFO, logger="kvstore.index_fallback"):
        assert index.try_resync() is True
    assert index.mode is Mode.UP
    assert index.last_resync == ResyncCounts(num_workers=2, num_blocks=3, num_replayed=0)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "resynced 2 workers and 3 blocks" in infos[0].getMessage()
    fresh = fresh_view(server.url)  # Redis itself got the local view back, loads included
    assert fresh.match(KEYS[:4]).get("w1") == WorkerMatch("w1", 3, 3, (M, M, D))
    assert fresh.workers() == index.local.workers()
    index.apply([BlockEvent.removed("w1", KEYS[1])])  # and writes reach it again
    assert fresh.match(KEYS[:4]).get("w1") == WorkerMatch("w1", 1, 0, (M,))

    caplog.clear()
    server.kill()  # a second outage warns once more
    with caplog.at_level(logging.WARNING, logger="kvstore.index_fallback"):
        assert index.match(KEYS[:4]).get("w1") == WorkerMatch("w1", 1, 0, (M,))
        index.match(KEYS[:4])
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    fresh.close()
    index.close()


def test_resync_makes_redis_exact_after_a_hang(redis_server_factory: Callable[[], RedisServer]) -> None:
    """Redis hung (kept its state) while the Conductor saw a block evicted and a worker re-register
    with a new process: after the resync Redis holds exactly the local view, nothing stale."""
    server = redis_server_factory()
    config = RedisIndexConfig(ttl_s=LONG_TTL_S, connect_timeout_s=0.1, socket_timeout_s=0.1, retry_budget_s=0.05)
    index = FallbackIndex(RedisIndex(server.url, "fb", config), MemoryIndex(LONG_TTL_S), recover_in_background=False)
    index.register(info("w1"))
    index.register(info("w2"))
    index.apply([stored("w1", 0, snap=True), stored("w1", 1, snap=True), stored("w2", 0, snap=True)])
    index.heartbeat("w1", WorkerLoad(num_queued=3))

    server.pause()
    try:
        assert index.match(KEYS[:2]).get("w1") == WorkerMatch("w1", 2, 2, (M, M))  # times out, answers locally
        assert index.mode is Mode.DOWN
        index.apply([BlockEvent.removed("w1", KEYS[1])])
        index.heartbeat("w1", WorkerLoad(num_queued=1))
        index.remove("w2")  # a new process under the same id: its old blocks are gone
        index.register(info("w2"))
        index.apply([stored("w2", 3, S)])
    finally:
        server.resume()

    assert index.try_resync() is True
    fresh = fresh_view(server.url)
    assert fresh.match(KEYS[:4]).get("w1") == WorkerMatch("w1", 1, 1, (M,))
    assert fresh.match(KEYS[:4]).get("w2") == WorkerMatch("w2", 0, 0, ())
    assert fresh.match(KEYS[3:4]).get("w2") == WorkerMatch("w2", 1, 0, (S,))
    assert fresh.workers() == index.local.workers()
    assert dict(fresh.workers())[info("w1")] == WorkerLoad(num_queued=1)
    fresh.close()
    index.close()


def test_silent_restart_between_calls_is_noticed(redis_server_factory: Callable[[], RedisServer]) -> None:
    """Redis restarted empty with no call failing in between: the next call sees the lost
    scripts (server_epoch), answers locally, and the resync puts the view back."""
    server = redis_server_factory()
    index = fallback(server.url)
    index.register(info("w1"))
    index.apply([stored("w1", 0, snap=True)])
    assert index.match(KEYS[:1]).get("w1") == WorkerMatch("w1", 1, 1, (M,))
    server.kill()
    server.start()
    assert index.workers() == [(info("w1"), WorkerLoad.initial(info("w1")))]  # local's answer, not Redis's []
    assert index.mode is Mode.DOWN
    assert index.heartbeat("w1", WorkerLoad(num_queued=2)) is True  # the worker need not re-register
    assert index.try_resync() is True
    fresh = fresh_view(server.url)
    assert fresh.match(KEYS[:1]).get("w1") == WorkerMatch("w1", 1, 1, (M,))
    assert fresh.workers() == [(info("w1"), WorkerLoad(num_queued=2))]
    fresh.close()
    index.close()


def test_no_redis_round_trip_on_any_call_while_down(
    redis_server_factory: Callable[[], RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = redis_server_factory()
    index = fallback(server.url)
    index.register(info("w1"))
    server.kill()
    index.workers()  # meets the outage
    assert index.mode is Mode.DOWN

    num_io = [0]
    connect, send = redis.connection.Connection.connect, redis.connection.Connection.send_packed_command

    def counting(original):  # type: ignore[no-untyped-def]
        def wrapped(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            num_io[0] += 1
            return original(self, *args, **kwargs)

        return wrapped

    server.start()  # reachable again, yet nothing on the request path may find out by itself
    monkeypatch.setattr(redis.connection.Connection, "connect", counting(connect))
    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting(send))
    assert index.apply([stored("w1", 0, snap=True)]) == 1
    assert index.match(KEYS[:1]).get("w1") == WorkerMatch("w1", 1, 1, (M,))
    assert index.heartbeat("w1", WorkerLoad()) is True
    assert index.register(info("w2")) is True
    assert index.remove("w2") is True
    assert ids(index) == ["w1"]
    assert index.reap_expired() == ()
    assert num_io[0] == 0
    assert index.try_resync() is True  # the recovery path does talk to Redis
    assert num_io[0] > 0
    monkeypatch.undo()
    index.close()


class GatedRedisIndex(RedisIndex):
    """Holds a resync inside its first ``reset_worker`` until ``gate`` opens."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.entered, self.gate = threading.Event(), threading.Event()

    def reset_worker(self, worker: WorkerInfo, load: WorkerLoad) -> None:
        self.entered.set()
        assert self.gate.wait(JOIN_S)
        super().reset_worker(worker, load)


JOIN_S = 30.0


def test_writes_during_a_resync_neither_wait_nor_get_lost(redis_server_factory: Callable[[], RedisServer]) -> None:
    server = redis_server_factory()
    primary = GatedRedisIndex(server.url, "fb", RedisIndexConfig(ttl_s=LONG_TTL_S, retry_budget_s=0.2))
    index = FallbackIndex(primary, MemoryIndex(LONG_TTL_S), recover_in_background=False)
    primary.gate.set()
    index.register(info("w1"))
    index.apply([stored("w1", 0, snap=True)])
    server.kill()
    index.workers()
    server.start()

    primary.gate.clear()
    resync = threading.Thread(target=index.try_resync)
    resync.start()
    assert primary.entered.wait(JOIN_S)
    assert index.mode is Mode.RESYNCING

    def writes() -> None:
        index.apply([stored("w1", 1, snap=True), stored("w1", 2, D)])
        index.heartbeat("w1", WorkerLoad(num_queued=6))
        index.register(info("w2", WorkerRole.DECODE))
        index.apply([BlockEvent.removed("w1", KEYS[0])])

    writer = threading.Thread(target=writes)
    writer.start()
    writer.join(JOIN_S)
    assert not writer.is_alive() and resync.is_alive()  # the writes did not wait for the resync
    assert index.match(KEYS[:3]).get("w1") == WorkerMatch("w1", 0, 0, ())  # reads answer locally meanwhile
    primary.gate.set()
    resync.join(JOIN_S)
    assert not resync.is_alive()

    assert index.mode is Mode.UP
    assert index.last_resync == ResyncCounts(num_workers=1, num_blocks=1, num_replayed=4)
    fresh = fresh_view(server.url)
    assert fresh.match(KEYS[1:3]).get("w1") == WorkerMatch("w1", 2, 1, (M, D))
    assert fresh.match(KEYS[:1]).get("w1") == WorkerMatch("w1", 0, 0, ())
    assert fresh.workers() == index.local.workers()
    fresh.close()
    index.close()


def recovery_threads() -> int:
    return sum(t.name == "index-recovery" for t in threading.enumerate())


def test_recovery_thread_resyncs_without_any_call(redis_server_factory: Callable[[], RedisServer]) -> None:
    server = redis_server_factory()
    num_threads_before = recovery_threads()
    index = fallback(server.url, background=True, interval_s=0.05)
    index.register(info("w1"))
    index.apply([stored("w1", 0, snap=True)])
    assert recovery_threads() == num_threads_before  # started by the first outage only
    server.kill()
    index.match(KEYS[:1])
    assert index.mode is Mode.DOWN
    server.start()
    deadline_s = time.monotonic() + POLL_DEADLINE_S
    while index.mode is not Mode.UP and time.monotonic() < deadline_s:
        time.sleep(0.02)
    assert index.mode is Mode.UP
    fresh = fresh_view(server.url)
    assert fresh.match(KEYS[:1]).get("w1") == WorkerMatch("w1", 1, 1, (M,))
    fresh.close()
    index.close()
    assert recovery_threads() == num_threads_before


def test_fallback_with_redis_down_from_the_start() -> None:
    primary = RedisIndex(unreachable_url(), "t", RedisIndexConfig(retry_budget_s=0.05))
    index = FallbackIndex(primary, MemoryIndex(LONG_TTL_S), recover_in_background=False)
    assert index.register(info("w1")) is True
    assert index.apply([stored("w1", 0, snap=True)]) == 1
    assert index.match(KEYS[:2]).get("w1") == WorkerMatch("w1", 1, 1, (M,))
    assert index.try_resync() is False  # a retry fails again and it keeps answering locally
    assert ids(index) == ["w1"]
    assert not index.using_primary
    index.close()
