"""Eviction policies: exact victim order for each, and the contract every registered policy
keeps (pure selection, pins and view respected, enough bytes when possible)."""

from __future__ import annotations

import random

import pytest

from kvstore.blocks import BlockKey
from kvstore.eviction import (
    DEFAULT_POLICY,
    POLICIES,
    ArcPolicy,
    EvictionPolicy,
    EvictionView,
    LfuPolicy,
    LruPolicy,
    make_policy,
)


def k(name: str) -> BlockKey:
    return name.encode().ljust(16, b".")


def _view(keys: list[BlockKey], pinned: frozenset[BlockKey] = frozenset(), size: int = 1) -> EvictionView:
    return EvictionView({key: size for key in keys}, pinned)


def _fill(policy: EvictionPolicy, names: str) -> list[BlockKey]:
    keys = [k(c) for c in names]
    for key in keys:
        policy.on_insert(key)
    return keys


def _names(victims: list[BlockKey]) -> str:
    return "".join(v.rstrip(b".").decode() for v in victims)


# ----- exact order -----------------------------------------------------------------------


def test_lru_order() -> None:
    lru = LruPolicy()
    keys = _fill(lru, "abcd")
    lru.on_access(k("b"))
    view = _view(keys)
    assert _names(lru.select_victims(view, 2)) == "ac"
    assert _names(lru.select_victims(view, 10)) == "acdb"
    assert _names(lru.select_victims(_view(keys, frozenset({k("a")})), 2)) == "cd"
    assert lru.select_victims(view, 0) == []
    lru.on_remove(k("a"))
    assert _names(lru.select_victims(_view(keys[1:]), 1)) == "c"


def test_lfu_order_breaks_ties_by_recency() -> None:
    lfu = LfuPolicy()
    keys = _fill(lfu, "abcd")
    for name in "aabd":
        lfu.on_access(k(name))
    # frequencies: a=3, b=2, c=1, d=2; b reached 2 before d did
    assert _names(lfu.select_victims(_view(keys), 10)) == "cbda"
    assert _names(lfu.select_victims(_view(keys, frozenset({k("c")})), 2)) == "bd"
    lfu.on_remove(k("c"))
    lfu.on_insert(k("e"))
    assert _names(lfu.select_victims(_view([*keys, k("e")]), 1)) == "e"


def test_arc_order_and_adaptation() -> None:
    arc = ArcPolicy()
    keys = _fill(arc, "abc")
    arc.on_access(k("a"))  # a moves to T2; T1 = b c
    view = _view(keys)
    assert _names(arc.select_victims(view, 1)) == "b"
    assert _names(arc.select_victims(view, 3)) == "bca"
    arc.on_remove(k("b"))  # evicted from T1: becomes a B1 ghost
    assert arc.target_t1 == 0
    arc.on_insert(k("b"))  # a B1 ghost hit: T1 was too small, grow its target; b goes to T2
    assert arc.target_t1 == 1
    assert _names(arc.select_victims(view, 1)) == "a"  # T1 = c is within target: take T2's LRU
    assert _names(arc.select_victims(view, 3)) == "abc"  # T2 first, T1 once T2 runs dry


def test_arc_shrinks_t1_target_on_t2_ghost_hit() -> None:
    arc = ArcPolicy()
    _fill(arc, "ab")
    arc.on_remove(k("a"))
    arc.on_insert(k("a"))  # B1 hit: target 1
    arc.on_remove(k("a"))  # a was in T2: now a B2 ghost
    arc.on_insert(k("a"))  # B2 hit: T2 was too small
    assert arc.target_t1 == 0


@pytest.mark.parametrize(("name", "hot_survive"), [("lru", False), ("lfu", True), ("arc", True)])
def test_scan_resistance(name: str, hot_survive: bool) -> None:
    policy = make_policy(name)
    hot = _fill(policy, "wxyz")
    for key in hot:
        policy.on_access(key)
    scan = _fill(policy, "ABCDEFGHIJKLMNOP")
    victims = policy.select_victims(_view(hot + scan), 4)
    assert set(victims).isdisjoint(hot) == hot_survive


# ----- registry and contract -------------------------------------------------------------


def test_registry() -> None:
    assert DEFAULT_POLICY == "lru"
    assert {"lru", "lfu", "arc"} <= set(POLICIES)
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="registered"):
        make_policy("fifo-ish")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_selection_is_pure_and_respects_the_view(name: str) -> None:
    rng = random.Random(7)
    policy = make_policy(name)
    resident: set[BlockKey] = set()
    for step in range(400):
        key = k(f"b{rng.randrange(40)}")
        op = rng.random()
        if key not in resident:
            policy.on_insert(key)
            resident.add(key)
        elif op < 0.6:
            policy.on_access(key)
        else:
            policy.on_remove(key)
            resident.discard(key)
        if step % 20:
            continue
        sizes = {key: 1 + rng.randrange(5) for key in resident}
        pinned = frozenset(key for key in resident if rng.random() < 0.3)
        view = EvictionView(sizes, pinned)
        need = rng.randrange(1, 40)
        tracked = policy.tracked()
        victims = policy.select_victims(view, need)
        assert policy.select_victims(view, need) == victims, "selection must not change the policy"
        assert policy.tracked() == tracked == resident
        assert len(set(victims)) == len(victims)
        assert all(view.candidate(v) for v in victims)
        freed = sum(sizes[v] for v in victims)
        available = sum(size for key, size in sizes.items() if key not in pinned)
        assert freed >= min(need, available)
        if victims:
            assert freed - sizes[victims[-1]] < need, "no more victims than needed"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_keys_outside_the_view_are_not_candidates(name: str) -> None:
    policy = make_policy(name)
    keys = _fill(policy, "abc")
    assert policy.select_victims(_view(keys[1:2]), 10) == [keys[1]]
