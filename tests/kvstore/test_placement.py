"""``Placement`` over sized tiers (the simulator's store): a seeded script of puts, gets,
drops, pins and adoption-free churn over three tiers, for every eviction policy, must give
exactly the event log recorded from the recursive implementation it replaced (its digest
below), with the store's invariants checked along the way; plus the exact cascade of one
insert into full tiers."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvstore.blocks import Tier
from kvstore.placement import Placement, StoreEvent
from kvstore.sized import SizedBlob, SizedTier

D, M, S = Tier.DEVICE, Tier.DRAM, Tier.SSD

# sha256 of the event log of ``script(policy, seed)``, recorded with the recursive
# ``_insert -> _make_room -> _demote`` implementation (commit 34c8afa).
GOLDEN = {
    ("lru", 0): "3441f02f3439b4d21ce5e2357bf2ffdc32d278218a25e97a8be36901db930aa5",
    ("lru", 1): "eb4c33c55ad5bddd40079ed3ccffcb1a3aba109de85c5d5d7210ed11d5e2ea5c",
    ("lfu", 0): "841b606ebdd5e1197f3acbf1bdbce81dac1797c5ac32f1c0e7316922a3dbc28a",
    ("lfu", 1): "e6735bfb872005f698e56b58f021a4902cbd958df8f2672a4dd9939e73b75947",
    ("arc", 0): "10fad4a97b7c153f5479a119c2a029b0dfd23ef1c36fbfa5e02eb8bf0e40c01a",
    ("arc", 1): "0bfbade894f18a816830e7929111b9b1550f898a99891f8b52c9822361ed8889",
}


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def store(policy: str, capacities: tuple[int, int, int], events: list[StoreEvent]) -> Placement:
    tiers = {t: SizedTier(t, c) for t, c in zip((D, M, S), capacities, strict=True) if c}
    return Placement(tiers, policy, min(tiers), on_event=events.append)


def script(policy: str, seed: int, num_ops: int = 6000) -> tuple[list, Placement]:
    """Seeded operations of every kind the simulator and the live worker use on a sized store:
    puts at every tier (with and without snapshots, some too big for a tier), gets (which
    promote), drops, pins held across later operations; integrity checked every 100 steps.
    Returns the log (every event, and what each put and get answered) and the store."""
    rng = random.Random(f"{policy}/{seed}")
    events: list = []
    p = store(policy, (4000, 9000, 20000), events)
    pinned: list[bytes] = []
    for step in range(num_ops):
        op = rng.random()
        k = key(rng.randrange(120))
        if op < 0.55:
            size = rng.choice((500, 700, 1000, 1500, 4500, 500, 700, 1000, 25000))
            snap = rng.random() < 0.3
            events.append(("put", p.put(k, SizedBlob(size, snap), snap, rng.choice((D, D, D, M, S)))))
        elif op < 0.85:
            blob = p.get(k)
            events.append(("get", None if blob is None else blob.size_bytes))
        elif op < 0.92:
            if k in p.where and k not in p.pins:
                p.drop(k)
        elif op < 0.97:
            if k in p.where:
                p.pin(k)
                pinned.append(k)
        elif pinned:
            p.unpin(pinned.pop(rng.randrange(len(pinned))))
        if step % 100 == 0:
            p.check_integrity()
    p.check_integrity()
    return events, p


def digest(log: list, p: Placement) -> str:
    h = hashlib.sha256()
    for e in log:
        if isinstance(e, StoreEvent):
            h.update(f"{e.kind} {e.key.hex()} {int(e.tier)} {int(e.has_snapshot)}\n".encode())
        else:
            h.update(f"{e}\n".encode())
    h.update(repr(sorted((k.hex(), int(t)) for k, t in p.where.items())).encode())
    return h.hexdigest()


@pytest.mark.parametrize(("policy", "seed"), sorted(GOLDEN))
def test_the_event_log_of_a_seeded_script_is_unchanged(policy: str, seed: int) -> None:
    log, p = script(policy, seed)
    kinds = {e.kind if isinstance(e, StoreEvent) else (e[0], e[1] is not None and e[1] is not False) for e in log}
    assert kinds == {"stored", "moved", "removed", ("put", True), ("put", False), ("get", True), ("get", False)}
    assert digest(log, p) == GOLDEN[(policy, seed)]


def test_one_insert_into_full_tiers_cascades_deepest_first() -> None:
    events: list[StoreEvent] = []
    p = store("lru", (2000, 2000, 2000), events)
    for i in range(6):  # 2 blocks per tier, oldest at the bottom
        assert p.put(key(i), SizedBlob(1000, False), False, D)
    events.clear()
    assert p.put(key(9), SizedBlob(1000, True), True, D)
    # The SSD's oldest is dropped, then DRAM's oldest moves down, then the device's, then the new one lands.
    assert [(e.kind, e.key, e.tier, e.has_snapshot) for e in events] == [
        ("removed", key(0), S, False), ("moved", key(2), S, False), ("moved", key(4), M, False),
        ("stored", key(9), D, True)]
    assert {k: p.where[k] for k in p.where} == {key(1): S, key(2): S, key(3): M, key(4): M, key(5): D, key(9): D}
    p.check_integrity()


def test_a_block_too_big_for_a_tier_goes_to_the_next_and_a_pinned_victim_stays() -> None:
    events: list[StoreEvent] = []
    p = store("lru", (2000, 6000, 0), events)
    assert p.put(key(1), SizedBlob(1000, False), False, D)
    assert p.put(key(2), SizedBlob(3000, False), False, D)  # over the device's capacity: DRAM
    assert p.where == {key(1): D, key(2): M}
    p.pin(key(1))
    assert p.put(key(3), SizedBlob(1500, False), False, D)  # key 1 pinned: no room on the device
    assert p.where[key(3)] == M and p.where[key(1)] == D
    p.unpin(key(1))
    assert p.put(key(4), SizedBlob(1500, False), False, D)  # now key 1 moves down
    assert p.where[key(1)] == M and p.where[key(4)] == D
    p.check_integrity()
