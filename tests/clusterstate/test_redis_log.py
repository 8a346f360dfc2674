"""The cluster's log in a real Redis: replicas converge exactly, a late replica catches up
(from a snapshot or the whole stream) before it says it is ready, gaps are repaired, records
that are malformed, oversized or not a member's are dropped and logged once, the store may
vanish and come back empty, and signatures' nonces are shared."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import pytest
import redis

from clusterstate.log import EntryApplier, entry, record_of
from clusterstate.redis_log import RedisLog, RedisLogConfig
from clusterstate.state import ClusterState
from clusterstate.workers import WorkerLoad, WorkerRole
from kvstore.blocks import Tier, chain_keys
from proto import state_pb2 as spb
from proto.convert import block_event, load_to_proto
from tests.clusterstate.state_support import KEYS_OF_STORE, FakeClock, info

DEADLINE_S = 30.0  # a guard against hangs, never an assertion on speed


def replica(url: str, namespace: str, clock, **config) -> tuple[ClusterState, RedisLog]:
    state = ClusterState(ttl_s=1e6, clock=clock)  # the wall clock: log entries' times are wall times
    log_ = RedisLog(lambda: redis.Redis.from_url(url, socket_timeout=2), EntryApplier(state, KEYS_OF_STORE),
                    KEYS_OF_STORE, f"replica-{id(state)}", RedisLogConfig(namespace=namespace, read_block_ms=50,
                                                                          **config))
    log_.start()
    return state, log_


def wait(predicate, what: str) -> None:
    until = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < until, f"timed out waiting for {what}"
        time.sleep(0.01)


def publish_blocks(log_: RedisLog, clock: FakeClock, worker_id: str, keys: list[bytes], tier: Tier = Tier.DRAM):
    events = [block_event(k, tier, i % 2 == 0) for i, k in enumerate(keys)]
    log_.publish(entry(log_.replica_id, clock(), blocks=spb.BlocksEntry(worker_id=worker_id, events=events)))


def register(log_: RedisLog, clock: FakeClock, worker_id: str, role: WorkerRole = WorkerRole.PREFILL) -> None:
    log_.publish(entry(log_.replica_id, clock(), registered=record_of(info(worker_id, role), KEYS_OF_STORE)))


@pytest.mark.parametrize("snapshot_every", [1_000, 10**9], ids=["from-snapshot", "whole-stream"])
def test_a_replica_started_after_10000_block_events_converges_exactly_and_only_then_is_ready(
        redis_url: str, snapshot_every: int) -> None:
    clock, ns = time.time, f"late{snapshot_every}"
    first, first_log = replica(redis_url, ns, clock, snapshot_every_entries=snapshot_every)
    second, second_log = replica(redis_url, ns, clock, snapshot_every_entries=snapshot_every)
    try:
        for w in ("p0", "p1", "p2"):
            register(first_log, clock, w)
        keys = chain_keys(list(range(10_000)), block_size=1, model_fingerprint="late-replica")
        for i, key in enumerate(keys):  # 10,000 entries of one block event each, from both replicas
            publish_blocks(first_log if i % 2 else second_log, clock, f"p{i % 3}", [key], Tier(i % 3))
        def held(state: ClusterState) -> int:
            return sum(len(h) for _, h in state.export())

        wait(lambda: held(first) == held(second) == 10_000 and first_log.seq == second_log.seq,
             "both replicas to apply everything")
        assert first.digest() == second.digest()

        late, late_log = replica(redis_url, ns, clock, snapshot_every_entries=snapshot_every)
        try:
            until = time.monotonic() + DEADLINE_S
            while True:
                ready = late_log.ready
                digest = late.digest()
                if ready:  # ready is read first: the state it reports ready on is complete
                    assert digest == first.digest()
                    break
                assert time.monotonic() < until, "the late replica never caught up"
            assert late_log.lag_s == 0.0
            client = redis.Redis.from_url(redis_url)
            if snapshot_every < 10**9:  # snapshots were written, the stream trimmed up to the one before
                snapshot_seq = int(client.hget(f"{ns}:snapshot", "seq"))
                assert snapshot_seq >= 10_000 - snapshot_every
                assert client.xlen(f"{ns}:log") <= first_log.seq - snapshot_seq + 2 * snapshot_every
            else:
                assert not client.exists(f"{ns}:snapshot") and client.xlen(f"{ns}:log") == first_log.seq
        finally:
            late_log.close()
    finally:
        first_log.close()
        second_log.close()


class PausableRelay:
    """A TCP relay to Redis on loopback that can stop forwarding (a replica that falls behind)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.open = threading.Event()
        self.open.set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                self.open.wait()
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s_ in (a, b):
                with contextlib.suppress(OSError):
                    s_.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.open.set()
        self.server.close()


def test_a_replica_that_falls_a_snapshot_behind_repairs_from_it(
        redis_server, caplog: pytest.LogCaptureFixture) -> None:
    clock, ns = time.time, "gap"
    relay = PausableRelay(redis_server.port)
    state, log_ = replica(redis_server.url, ns, clock, snapshot_every_entries=10)
    lagging = ClusterState(ttl_s=1e6, clock=clock)
    lag_log = RedisLog(lambda: redis.Redis(host="127.0.0.1", port=relay.port, socket_timeout=20),
                       EntryApplier(lagging, KEYS_OF_STORE), KEYS_OF_STORE, "lagging",
                       RedisLogConfig(namespace=ns, read_block_ms=50, snapshot_every_entries=10**9))
    lag_log.start()
    try:
        register(log_, clock, "p0")
        keys = chain_keys(list(range(60)), block_size=1, model_fingerprint="gap")
        wait(lambda: lag_log.ready and lagging.worker("p0") is not None, "the second replica")
        relay.open.clear()  # it stops hearing from the store; the first replica goes on
        with caplog.at_level(logging.INFO, logger="clusterstate.redis_log"):
            for key in keys:
                publish_blocks(log_, clock, "p0", [key])
            wait(lambda: redis.Redis.from_url(redis_server.url).xlen(f"{ns}:log") < log_.seq - 20,
                 "the stream to be trimmed past the lagging replica")
            relay.open.set()
            wait(lambda: lag_log.num_resyncs >= 1 and lag_log.ready and lag_log.seq == log_.seq,
                 "the lagging replica to repair and follow")
        assert "log gap" in caplog.text and "state from the snapshot" in caplog.text
        assert lagging.digest() == state.digest()
        assert log_.num_resyncs == 0  # the replica that kept up read on without one
    finally:
        log_.close()
        lag_log.close()
        relay.close()


def test_malformed_oversized_and_foreign_records_are_dropped_and_logged_once(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    clock, ns = time.time, "garbage"
    state, log_ = replica(redis_url, ns, clock)
    try:
        register(log_, clock, "p0")
        register(log_, clock, "d0", WorkerRole.DECODE)
        client = redis.Redis.from_url(redis_url)
        good = entry("x", clock(), heartbeat=spb.HeartbeatEntry(worker_id="d0", load=load_to_proto(
            WorkerLoad(num_free_pages=0, timestamp_s=1.0))))
        forged = {b"e": good.SerializeToString(), b"m": b"\0" * 16}  # a local process without the secret
        records = [
            {b"e": b"{not json", b"m": b"x"},  # malformed
            forged,  # foreign: its MAC does not hold
            {b"e": b"\x01" * (5 << 20), b"m": b"\0" * 16},  # oversized
            {b"junk": b"1"},  # no entry at all
        ]
        with caplog.at_level(logging.WARNING, logger="clusterstate.redis_log"):
            for fields in records:
                client.xadd(f"{ns}:log", {b"s": str(client.incr(f"{ns}:seq")).encode(), **fields})
            register(log_, clock, "p1")  # and the log goes on
            wait(lambda: state.worker("p1") is not None, "the entry after the garbage")
        drops = [r.getMessage() for r in caplog.records if "dropped log record" in r.getMessage()]
        assert len(drops) == 4, drops
        assert any("MAC" in d for d in drops) and any("over the" in d for d in drops)
        assert [w.worker_id for w, _ in state.workers()] == ["d0", "p0", "p1"]
        assert state.workers()[0][1].num_free_pages == WorkerLoad.initial(info("d0")).num_free_pages  # not forged
    finally:
        log_.close()


def test_the_store_restarted_empty_keeps_every_replica_state_and_a_new_one_finds_it(
        redis_server_factory, caplog: pytest.LogCaptureFixture) -> None:
    server = redis_server_factory()
    clock, ns = time.time, "restart"
    state, log_ = replica(server.url, ns, clock, snapshot_every_entries=10**6, snapshot_every_s=0.2)
    try:
        register(log_, clock, "p0")
        publish_blocks(log_, clock, "p0", chain_keys(list(range(8)), 1, "restart"))
        before = state.digest()
        with caplog.at_level(logging.WARNING, logger="clusterstate.redis_log"):
            server.kill()
            register(log_, clock, "p1")  # while the store is down: applied here, kept for later
            assert state.worker("p1") is not None and log_.degraded
            server.start()
            wait(lambda: not log_.degraded and log_.epoch is not None and log_.ready, "the replica to recover")
            # It may read the new log (a gap) before it sees the new epoch: both come, in either order.
            wait(lambda: "lost its data" in caplog.text, "the replica to see that the store lost its data")
            wait(lambda: redis.Redis.from_url(server.url).exists(f"{ns}:snapshot"), "a snapshot of the new epoch")
        assert state.digest() != before and {w.worker_id for w, _ in state.workers()} == {"p0", "p1"}
        late, late_log = replica(server.url, ns, clock)
        try:
            wait(lambda: late_log.ready and late.digest() == state.digest(), "a new replica to find the state")
        finally:
            late_log.close()
    finally:
        log_.close()


def test_signature_nonces_are_shared_by_every_replica(redis_url: str) -> None:
    clock = time.time
    _, a = replica(redis_url, "nonces", clock)
    _, b = replica(redis_url, "nonces", clock)
    try:
        expires = time.time() + 60
        assert a.first_use("n1", expires) is True
        assert b.first_use("n1", expires) is False
        assert a.first_use("n1", expires) is False
        assert b.first_use("n2", expires) is True
    finally:
        a.close()
        b.close()


def test_a_replica_starting_on_a_quiet_log_renews_the_leases_of_the_workers_alive_then(redis_url: str) -> None:
    """No Conductor wrote to the log for a while (a lone Conductor crashed and restarts): the
    workers alive when it went quiet are not held to the silence no one could hear; their
    leases run from the new replica's start. A worker already expired then stays expired, and
    a replica starting beside a live one renews nothing."""
    ns, ttl_s = "quiet", 3.0

    def start(**config) -> tuple[ClusterState, RedisLog]:
        state = ClusterState(ttl_s=ttl_s, clock=time.time)
        log_ = RedisLog(lambda: redis.Redis.from_url(redis_url, socket_timeout=2), EntryApplier(state, KEYS_OF_STORE),
                        KEYS_OF_STORE, f"replica-{id(state)}", RedisLogConfig(namespace=ns, read_block_ms=50,
                                                                              quiet_s=1.0, **config))
        log_.start()
        wait(lambda: log_.ready, "the replica to be ready")
        return state, log_

    def last_seen(state: ClusterState) -> dict[str, float]:
        return {w.info.worker_id: w.last_seen_s for w, _ in state.export()}

    _, first = start()
    t0 = time.time()
    for worker_id, at_s in (("gone", t0 - 2 * ttl_s), ("alive", t0)):
        first.publish(entry(first.replica_id, at_s, registered=record_of(info(worker_id), KEYS_OF_STORE)))
    first.close()  # the last Conductor stops: nothing is written for a while
    time.sleep(1.5)
    second, second_log = start()
    try:
        renewed = last_seen(second)
        assert renewed["gone"] == t0 - 2 * ttl_s  # expired before the quiet: not brought back
        assert renewed["alive"] > t0 + 1.0  # the lease runs from the second replica's start
        assert second.worker("alive") is not None and second.worker("gone") is None
        third, third_log = start()  # the log is not quiet: the second replica writes to it
        try:
            assert last_seen(third) == renewed
        finally:
            third_log.close()
    finally:
        second_log.close()
