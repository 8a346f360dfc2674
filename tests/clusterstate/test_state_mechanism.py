"""The in-memory cluster state's own mechanism, with an injected clock: exact lease
arithmetic, reaping, stored events replayed, integrity checks, concurrent threads, row widening
and slot reuse, the alive ids kept between changes. The contract every backend keeps is in
test_state.py."""

from __future__ import annotations

import random
import threading

import pytest

from clusterstate.state import ClusterState
from clusterstate.workers import WorkerLoad
from kvstore.blocks import Tier
from kvstore.index import BlockEvent, WorkerMatch
from kvstore.placement import StoreEvent
from tests.clusterstate.state_support import KEYS, D, FakeClock, M, S, ids, info, stored


def test_state_lease_expires_exactly_at_ttl_and_heartbeats_renew() -> None:
    clock = FakeClock()
    index = ClusterState(ttl_s=2.0, clock=clock)
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
    index.check_integrity()


def test_state_writes_reap_expired_workers() -> None:
    clock = FakeClock()
    index = ClusterState(ttl_s=1.0, clock=clock)
    index.register(info("w1"))
    index.apply([stored("w1", i) for i in range(4)])
    clock.advance(1.0)
    index.register(info("w2"))  # any write reaps
    assert index.reap_expired() == ()
    assert index.stored_events() == []
    index.check_integrity()


def test_state_stored_events_replay_into_an_equal_index() -> None:
    clock = FakeClock()
    source, copy = ClusterState(clock=clock), ClusterState(clock=clock)
    for index in (source, copy):
        index.register(info("w1"))
        index.register(info("w2"))
    source.apply([stored("w1", i, Tier(i % 3), snap=i % 2 == 1) for i in range(6)] + [stored("w2", 0, D)])
    copy.apply(source.stored_events())
    assert copy.match(KEYS) == source.match(KEYS)
    assert sorted(copy.stored_events(), key=repr) == sorted(source.stored_events(), key=repr)


def test_state_store_events_apply_as_their_block_events() -> None:
    """A prefill worker's store changes (the simulator's path) hold what their BlockEvents
    would; a worker that is not alive gets nothing, and a bad key is refused."""
    clock = FakeClock()
    direct, batched = ClusterState(ttl_s=5.0, clock=clock), ClusterState(ttl_s=5.0, clock=clock)
    for index in (direct, batched):
        index.register(info("w1"))
    changes = [StoreEvent("stored", KEYS[i], Tier(i % 3), i % 2 == 1) for i in range(6)]
    changes += [StoreEvent("moved", KEYS[2], S, False), StoreEvent("removed", KEYS[4], D, False)]
    direct.apply([BlockEvent.removed("w1", e.key) if e.kind == "removed" else
                  BlockEvent.stored("w1", e.key, e.tier, e.has_snapshot) for e in changes])
    assert batched.apply_store_events("w1", changes) == len(changes)
    assert batched.blocks_digest() == direct.blocks_digest()
    assert batched.match(KEYS) == direct.match(KEYS)
    batched.check_integrity()
    assert batched.apply_store_events("nobody", changes) == 0
    with pytest.raises(ValueError):
        batched.apply_store_events("w1", [StoreEvent("stored", b"short", D, False)])
    clock.advance(5.0)
    assert batched.apply_store_events("w1", changes[:1]) == 0


def test_state_check_integrity_detects_a_broken_mirror() -> None:
    index = ClusterState(clock=FakeClock())
    index.register(info("w1"))
    index.apply([stored("w1", 0)])
    index.check_integrity()
    index._blocks._worker_blocks["w1"].clear()  # break the invariant behind the index's back
    with pytest.raises(AssertionError):
        index.check_integrity()


def test_state_index_is_consistent_under_concurrent_threads() -> None:
    index = ClusterState(clock=FakeClock())
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


def test_worker_match_keeps_tiers_as_bytes() -> None:
    match = WorkerMatch("w1", 3, 2, (S, D, M))
    assert match.tiers == bytes([S, D, M]) and match.tiers[0] == S
    assert match == WorkerMatch("w1", 3, 2, bytes([2, 0, 1]))
    assert match.slowest_usable_tier is S
    assert WorkerMatch("w1", 3, 2, (M, D, S)).slowest_usable_tier is M  # the SSD block is not usable
    assert WorkerMatch("w1", 2, 0, (S, S)).slowest_usable_tier is None


def test_state_rows_widen_past_16_workers_and_free_slots_are_reused() -> None:
    index = ClusterState(clock=FakeClock())
    workers = [f"w{i:02d}" for i in range(40)]
    for worker_id in workers:
        index.register(info(worker_id))
    for i, worker_id in enumerate(workers):  # w_i holds keys[0 : i % 8 + 1], a snapshot at the end
        depth = i % 8 + 1
        index.apply([stored(worker_id, j, Tier(i % 3), snap=j == depth - 1) for j in range(depth)])
    index.check_integrity()
    assert index._blocks._width == 64  # 16 -> 32 -> 64
    snapshot = index.match(KEYS)
    assert [m.num_blocks_usable for m in snapshot.matches] == [i % 8 + 1 for i in range(40)]
    assert snapshot.get("w10") == WorkerMatch("w10", 3, 3, (M, M, M))
    for worker_id in workers[:20]:
        index.remove(worker_id)
    index.apply([stored("w38", 0, D)])  # moves its first block (of 7 on SSD) to DEVICE
    index.register(info("new"))
    index.apply([stored("new", 0, M, snap=True)])
    index.check_integrity()
    assert index._blocks._width == 64 and index._blocks._slots["new"] < 20  # took a slot the removed workers freed
    assert index.match(KEYS[:2]).get("new") == WorkerMatch("new", 1, 1, (M,))
    assert index.match(KEYS).get("w38") == WorkerMatch("w38", 7, 7, (D,) + (S,) * 6)
    for worker_id in [*workers[20:], "new"]:
        index.remove(worker_id)
    index.check_integrity()
    assert index._blocks._rows == {} and index.stored_events() == []


def test_alive_ids_kept_between_changes_equal_a_fresh_pass_at_every_moment() -> None:
    """The registry keeps its alive ids between changes (a match asks on every decision): under
    random registrations, heartbeats, removals, reaps and clock moves (backwards too), the kept
    answer is always the plain lease test over every entry."""
    from clusterstate.registry import WorkerRegistry

    rng = random.Random(7)
    clock = FakeClock()
    registry = WorkerRegistry(ttl_s=2.0, clock=clock)
    names = [f"w{i}" for i in range(6)]
    num_kept = 0
    for _ in range(3000):
        op = rng.random()
        w = rng.choice(names)
        if op < 0.2:
            registry.register(info(w))
        elif op < 0.4:
            registry.heartbeat(w, WorkerLoad())
        elif op < 0.45:
            registry.remove(w)
        elif op < 0.5:
            registry.reap_expired(grace_s=rng.choice((0.0, 1.0)))
        elif op < 0.9:
            clock.advance(rng.choice((0.001, 0.25, 0.5, 1.0, 1.999, 2.0)))
        else:
            clock.advance(-rng.choice((0.001, 0.5, 2.0)))
        kept = registry._alive
        expected = sorted(e.info.worker_id for e in registry.entries() if clock() - e.last_seen_s < registry.ttl_s)
        assert registry.alive_ids() == expected
        num_kept += kept is not None and registry._alive is kept
    assert num_kept > 500  # the kept answer was used, not only remade
