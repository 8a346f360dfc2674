"""Eviction policies: which blocks of one tier to give up when it needs room.

A policy keeps only access metadata, fed by the tier's owner through ``on_insert``,
``on_access`` and ``on_remove``. Choosing victims is pure: ``select_victims(view,
need_bytes)`` reads the metadata and a read-only ``EvictionView`` of the tier (sizes and
pins) and returns keys in eviction order; it changes nothing, and the store applies (or
discards) the choice. The same policy objects therefore run in the store and in the
simulator. Policies are not thread-safe; the store calls them under its lock.

Registered by name in ``POLICIES``: ``lru`` (default), ``lfu`` (least frequently used, ties
broken by least recent), ``arc`` (Adaptive Replacement Cache, Megiddo & Modha, FAST'03:
scan-resistant, a one-time scan only churns the recency list T1 while blocks used twice
sit in T2).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Protocol

from kvstore.blocks import BlockKey


@dataclasses.dataclass(frozen=True)
class EvictionView:
    """Read-only view of one tier: every resident key with its size, and the pinned keys.
    Keys the policy tracks but the view lacks are not candidates."""

    sizes_bytes: Mapping[BlockKey, int]
    pinned: Collection[BlockKey]

    def candidate(self, key: BlockKey) -> bool:
        return key in self.sizes_bytes and key not in self.pinned


class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, key: BlockKey) -> None: ...
    def on_access(self, key: BlockKey) -> None: ...
    def on_remove(self, key: BlockKey) -> None: ...
    def tracked(self) -> set[BlockKey]: ...
    def select_victims(self, view: EvictionView, need_bytes: int) -> list[BlockKey]: ...


def take_until(view: EvictionView, order: Iterable[BlockKey], need_bytes: int) -> list[BlockKey]:
    """Unpinned keys of ``order`` (best victim first) until their sizes reach ``need_bytes``;
    all candidates when they cannot."""
    victims: list[BlockKey] = []
    freed = 0
    sizes, pinned = view.sizes_bytes, view.pinned
    for key in order:
        if freed >= need_bytes:
            break
        if key in sizes and key not in pinned:  # view.candidate(key), inline: this runs per block evicted
            victims.append(key)
            freed += sizes[key]
    return victims


class LruPolicy:
    """Least recently inserted or accessed first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()  # oldest first

    def on_insert(self, key: BlockKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def tracked(self) -> set[BlockKey]:
        return set(self._order)

    def select_victims(self, view: EvictionView, need_bytes: int) -> list[BlockKey]:
        return take_until(view, self._order, need_bytes)


class LfuPolicy:
    """Fewest accesses first (an insert counts as one); ties go to the least recent.
    Frequency buckets keep each update O(1) but for the sorted list of the frequencies in use
    (a bisect when a bucket appears or empties), so a choice never sorts."""

    name = "lfu"

    def __init__(self) -> None:
        self._freq: dict[BlockKey, int] = {}
        self._buckets: dict[int, OrderedDict[BlockKey, None]] = {}  # freq -> keys, oldest first
        self._freqs: list[int] = []  # the keys of _buckets, ascending

    def _place(self, key: BlockKey, freq: int) -> None:
        self._freq[key] = freq
        bucket = self._buckets.get(freq)
        if bucket is None:
            bucket = self._buckets[freq] = OrderedDict()
            bisect.insort(self._freqs, freq)
        bucket[key] = None

    def _unplace(self, key: BlockKey) -> int:
        freq = self._freq.pop(key)
        bucket = self._buckets[freq]
        del bucket[key]
        if not bucket:
            del self._buckets[freq]
            del self._freqs[bisect.bisect_left(self._freqs, freq)]
        return freq

    def on_insert(self, key: BlockKey) -> None:
        if key in self._freq:
            self._unplace(key)
        self._place(key, 1)

    def on_access(self, key: BlockKey) -> None:
        if key in self._freq:
            self._place(key, self._unplace(key) + 1)

    def on_remove(self, key: BlockKey) -> None:
        if key in self._freq:
            self._unplace(key)

    def tracked(self) -> set[BlockKey]:
        return set(self._freq)

    def _order(self) -> Iterator[BlockKey]:
        for freq in self._freqs:  # a choice changes nothing, so the list is stable while this runs
            yield from self._buckets[freq]

    def select_victims(self, view: EvictionView, need_bytes: int) -> list[BlockKey]:
        return take_until(view, self._order(), need_bytes)


class ArcPolicy:
    """Adaptive Replacement Cache over entry counts.

    T1: keys seen once recently; T2: keys seen at least twice; B1/B2: ghosts (keys recently
    evicted from T1/T2, no data). ``target_t1`` (ARC's p) adapts: a re-inserted B1 ghost
    means T1 was too small, a B2 ghost that T2 was. The cache size c in entries is the
    high-water mark of resident keys, since the store's budget is in bytes.
    """

    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[BlockKey, None] = OrderedDict()  # LRU first
        self._t2: OrderedDict[BlockKey, None] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        self.target_t1 = 0.0
        self._capacity_entries = 0

    def on_insert(self, key: BlockKey) -> None:
        self.on_remove(key, ghost=False)
        if key in self._b1:
            self.target_t1 = min(self._capacity_entries, self.target_t1 + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.target_t1 = max(0.0, self.target_t1 - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._capacity_entries = max(self._capacity_entries, len(self._t1) + len(self._t2))

    def on_access(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def on_remove(self, key: BlockKey, ghost: bool = True) -> None:
        """Forget a resident key; by default remember it as a ghost of the list it left."""
        for resident, ghosts in ((self._t1, self._b1), (self._t2, self._b2)):
            if key in resident:
                del resident[key]
                if ghost:
                    ghosts[key] = None
                    while len(ghosts) > max(self._capacity_entries, 1):
                        ghosts.popitem(last=False)

    def tracked(self) -> set[BlockKey]:
        return set(self._t1) | set(self._t2)

    def select_victims(self, view: EvictionView, need_bytes: int) -> list[BlockKey]:
        # ARC's REPLACE, repeated on a simulated T1 length: take T1's LRU while T1 exceeds
        # its target, else T2's LRU; fall back to the other list when one runs dry.
        t1 = (k for k in self._t1 if view.candidate(k))
        t2 = (k for k in self._t2 if view.candidate(k))
        t1_len = len(self._t1)
        victims: list[BlockKey] = []
        freed = 0
        while freed < need_bytes:
            first, second = (t1, t2) if t1_len > self.target_t1 else (t2, t1)
            key = next(first, None)
            if key is None:
                key = next(second, None)
            if key is None:
                break
            if key in self._t1:
                t1_len -= 1
            victims.append(key)
            freed += view.sizes_bytes[key]
        return victims


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    LruPolicy.name: LruPolicy,
    LfuPolicy.name: LfuPolicy,
    ArcPolicy.name: ArcPolicy,
}
DEFAULT_POLICY = LruPolicy.name


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy registered as ``name``; ValueError names the registered ones."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; registered: {sorted(POLICIES)}")
    return POLICIES[name]()
