"""The cluster state's contract: every test runs on a state changed directly and on replicas
changed through a log in Redis. The in-memory state's own mechanism (leases, integrity, slots,
with an injected clock) is in test_state_mechanism.py; the shared log's own behaviour (gaps,
snapshots, outages) in test_redis_log.py."""

from __future__ import annotations

import math
import random

import pytest

from clusterstate.workers import PrefillJobLoad, WorkerInfo, WorkerLoad, WorkerRole
from kvstore.blocks import Tier, chain_keys
from kvstore.hitrule import leading_present, usable_prefix
from kvstore.index import BlockEvent, MatchSnapshot, WorkerMatch
from tests.clusterstate.state_support import (
    KEYS,
    D,
    Harness,
    M,
    S,
    check,
    ids,
    info,
    stored,
)

# --- contract: every backend -------------------------------------------------------------


def test_apply_and_match_basics(harness: Harness) -> None:
    index = harness.make()
    assert index.register(info("w1")) is True
    assert index.register(info("w2", WorkerRole.DECODE)) is True
    events = [stored("w1", 0), stored("w1", 1), stored("w1", 2, snap=True), stored("w2", 0)]
    assert index.apply(events) == 4

    snapshot = index.match(KEYS[:4])
    assert snapshot == MatchSnapshot(4, (WorkerMatch("w1", 3, 3, (M, M, M)), WorkerMatch("w2", 1, 0, (M,))))
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
    load = WorkerLoad(num_queued=3, num_running=2, num_free_pages=7, num_context_tokens=512,
                      prefill_jobs=(PrefillJobLoad("r1", 100, 32, 0.5), PrefillJobLoad("r2", 7)),
                      request_ids=("r3",), timestamp_s=1.7e9 + 0.25)  # fmt: skip
    assert index.heartbeat("w1", load) is True
    assert index.heartbeat("nobody", load) is False
    assert index.workers()[0] == (w1, load)
    # Registering an alive worker again refreshes its info but keeps load and blocks.
    index.apply([stored("w1", 0, snap=True)])
    moved = WorkerInfo("w1", WorkerRole.PREFILL, "10.0.0.1:1", 64, 1, 2, instance_id=w1.instance_id)
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
    index.check_integrity()
    assert (index.state if hasattr(index, "state") else index).stored_events() == []


def test_invalid_inputs_raise_value_error(harness: Harness) -> None:
    index = harness.make()
    with pytest.raises(ValueError, match="16 bytes"):
        index.match([b"short"])
    index.register(info("w1"))
    index.apply([stored("w1", 0)])
    for bad in (bytearray(16), "x" * 16, b"y" * 17):  # after a key the index holds, too
        with pytest.raises(ValueError, match="16 bytes"):
            index.match([KEYS[0], bad])
    with pytest.raises(ValueError, match="16 bytes"):
        BlockEvent.stored("w1", b"x" * 15, Tier.DRAM)
    with pytest.raises(ValueError, match="tier"):
        BlockEvent("w1", KEYS[0], None, False, BlockEvent.stored("w", KEYS[0], D).kind)
    with pytest.raises(ValueError, match="num_pages_total"):
        WorkerInfo("w1", WorkerRole.DECODE, "a:1", -1, 0, 0)
    with pytest.raises(ValueError, match="num_queued"):
        WorkerLoad(num_queued=-1)
    with pytest.raises(ValueError, match="negative"):
        PrefillJobLoad("r", -1)
    for elapsed_s in (-0.5, math.nan, math.inf):  # a heartbeat's NaN would pass a plain `< 0` test
        with pytest.raises(ValueError, match="elapsed_s not finite"):
            PrefillJobLoad("r", 10, 0, elapsed_s)


def _hit_rule_match(holdings: dict[str, dict[bytes, tuple[Tier, bool]]], alive: list[str],
                    keys: list[bytes]) -> MatchSnapshot:
    """What ``match`` must answer, from the hybrid hit rule over each worker's holdings."""
    matches = []
    for worker_id in sorted(alive):
        held = holdings.get(worker_id, {})
        tiers = [held[k][0] if k in held else None for k in keys]
        present = leading_present(tiers)
        usable = usable_prefix(tiers, [k in held and held[k][1] for k in keys])
        matches.append(WorkerMatch(worker_id, present, usable, tuple(tiers[:present])))
    return MatchSnapshot(len(keys), tuple(matches))


def test_match_follows_the_hit_rule_on_random_holdings(harness: Harness) -> None:
    # 20 workers (more than a memory row's first 16 slots) storing, moving and dropping blocks
    # of one 12-key chain, some of them removed and registered again; every match, of the chain,
    # of its slices and of keys out of order, is what the hit rule says of what each holds.
    rng = random.Random(7)
    keys = chain_keys(list(range(48)), block_size=4, model_fingerprint="random-holdings")
    index = harness.make()
    workers = [f"w{i:02d}" for i in range(20)]
    holdings: dict[str, dict[bytes, tuple[Tier, bool]]] = {w: {} for w in workers}
    for worker_id in workers:
        index.register(info(worker_id))
    for round_ in range(12):
        events = []
        for _ in range(40):
            worker_id, key = rng.choice(workers), rng.choice(keys[: rng.randint(1, len(keys))])
            if rng.random() < 0.8:
                tier, snap = rng.choice(list(Tier)), rng.random() < 0.4
                events.append(BlockEvent.stored(worker_id, key, tier, snap))
                holdings[worker_id][key] = (tier, snap)
            else:
                events.append(BlockEvent.removed(worker_id, key))
                holdings[worker_id].pop(key, None)
        assert index.apply(events) == len(events)
        if round_ % 4 == 3:  # a worker leaves with its blocks; another comes back empty
            gone = rng.choice(workers)
            index.remove(gone)
            holdings[gone] = {}
            # Matched without it (the answers' workers change), then with it again.
            assert_match(index, keys, _hit_rule_match(holdings, [w for w in workers if w != gone], keys))
            index.register(info(gone))
        shuffled = rng.sample(keys, len(keys))
        for query in (keys, keys[: rng.randint(0, len(keys))], keys[rng.randint(1, 6):], shuffled):
            assert_match(index, query, _hit_rule_match(holdings, workers, query))
    check(index)


def assert_match(index, keys: list[bytes], expected: MatchSnapshot) -> None:
    """``index.match(keys)`` is ``expected``, and its ``held`` are its matches that hold a block."""
    got = index.match(keys)
    assert got == expected
    assert got.held == tuple(m for m in expected.matches if m.num_blocks_present)
