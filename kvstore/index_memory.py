"""Embedded global index: block holdings and worker registry in one process (the Conductor).

Owns ``worker_id -> {key: BlockHold}`` (what each worker holds; purging a worker takes time
proportional to its own blocks), its mirror for matching, ``key -> row``, and a
``WorkerRegistry``. A worker that holds blocks has a *slot*, a column of every row: the byte
``row[slot]`` is 0 where the worker does not hold the key, else ``1 + 2 * tier + snapshot``.
A match looks each key up once and cuts one column per worker out of the joined rows, so
the per-block work is C (dict lookups, ``bytes`` slicing and ``translate``), never a Python
object per block::

    rows (width 4)   slot 0  1  2  3          matrix = b"".join(rows)
    keys[0]               3  4  0  0          column of slot 1 = matrix[1::4] = 4 3 4
    keys[1]               4  3  0  0          -> 3 blocks present; 4 = 1 + 2*DRAM + snapshot,
    keys[2]               0  4  0  0             so the last snapshot ends block 2: usable 3
    keys[3]               (no row: held by nobody, the scan stops here)

Slots are reused once their worker holds nothing; rows widen (doubling) when a new slot
does not fit. Locking: one ``threading.Lock`` guards all of it; every public method takes it
exactly once and, while holding it, calls only the registry and pure value code (no other
lock, no I/O), so gRPC handler threads may call any method concurrently.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import threading
import time
from collections.abc import Sequence

from kvstore.blocks import BlockKey, Tier
from kvstore.hitrule import usable_length
from kvstore.index import (
    BlockEvent,
    BlockEventKind,
    GlobalIndex,
    MatchSnapshot,
    WorkerInfo,
    WorkerLoad,
    WorkerMatch,
    check_keys,
)
from kvstore.registry import Clock, WorkerRegistry

assert 2 * max(Tier) + 2 < 256, "a row byte holds 1 + 2 * tier + snapshot"
_MIN_WIDTH = 16  # slots a row has at first; doubled when a new one does not fit
# Row byte -> the tier / the snapshot flag it encodes (bytes.translate tables; 0 -> 0).
_TIER_OF_CODE = bytes((c - 1) // 2 if 0 < c <= 2 * len(Tier) else 0 for c in range(256))
_SNAPSHOT_OF_CODE = bytes((c - 1) % 2 if 0 < c <= 2 * len(Tier) else 0 for c in range(256))


@dataclasses.dataclass(frozen=True, slots=True)
class BlockHold:
    """One worker's holding of one block."""

    tier: Tier
    has_snapshot: bool

    @property
    def code(self) -> int:
        """The row byte of this holding (see the module docstring)."""
        return 1 + 2 * int(self.tier) + int(self.has_snapshot)


# Every holding there can be, made once (they are frozen values): an event takes its own.
_HOLDS = {(tier, snapshot): BlockHold(tier, snapshot) for tier in Tier for snapshot in (False, True)}


class MemoryIndex(GlobalIndex):
    """In-memory ``GlobalIndex``; ``ttl_s`` is the heartbeat lease, ``clock`` a monotonic clock (s)."""

    def __init__(self, ttl_s: float = 10.0, clock: Clock = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._registry = WorkerRegistry(ttl_s, clock)
        self._worker_blocks: dict[str, dict[BlockKey, BlockHold]] = {}
        self._rows: dict[BlockKey, bytearray] = {}  # the same holdings, by key: one byte per slot
        self._slots: dict[str, int] = {}  # exactly the workers of _worker_blocks
        self._width = _MIN_WIDTH  # bytes in every row
        self._free_slots = list(range(self._width - 1, -1, -1))  # pop(): the last freed, else lowest unused
        self._empty_matches: dict[str, WorkerMatch] = {}  # made once per worker; forgotten with its blocks

    @property
    def ttl_s(self) -> float:
        return self._registry.ttl_s

    def apply(self, events: Sequence[BlockEvent]) -> int:
        with self._lock:
            self._reap_locked()
            num_applied = 0
            is_alive = self._registry.is_alive
            for event in events:
                if not is_alive(event.worker_id):
                    continue
                if event.kind is BlockEventKind.STORED:
                    assert event.tier is not None
                    hold = _HOLDS.get((event.tier, event.has_snapshot)) or BlockHold(event.tier, event.has_snapshot)
                    self._store_locked(event.worker_id, event.key, hold)
                else:
                    self._drop_locked(event.worker_id, event.key)
                num_applied += 1
            return num_applied

    def match(self, keys: Sequence[BlockKey]) -> MatchSnapshot:
        with self._lock:
            # Rows up to the first key nobody holds (every prefix ends there), as one matrix.
            try:
                rows = list(itertools.takewhile(operator.truth, map(self._rows.get, keys)))
            except TypeError:  # an unhashable key: the check below names it
                rows = []
            check_keys(keys[len(rows) :])  # the keys found were checked when they were stored
            matrix = b"".join(rows)
            matches = tuple(self._worker_match_locked(w, matrix) for w in self._registry.alive_ids())
            return MatchSnapshot(len(keys), matches)

    def register(self, worker: WorkerInfo) -> bool:
        with self._lock:
            self._reap_locked()
            is_new = self._registry.register(worker)
            if is_new:
                self._purge_blocks_locked(worker.worker_id)
            return is_new

    def heartbeat(self, worker_id: str, load: WorkerLoad) -> bool:
        with self._lock:
            return self._registry.heartbeat(worker_id, load)

    def workers(self) -> list[tuple[WorkerInfo, WorkerLoad]]:
        with self._lock:
            return self._registry.workers()

    def remove(self, worker_id: str) -> bool:
        with self._lock:
            self._purge_blocks_locked(worker_id)
            return self._registry.remove(worker_id)

    def reap_expired(self) -> tuple[str, ...]:
        with self._lock:
            return self._reap_locked()

    def try_hold(self, worker_id: str, key: BlockKey) -> BlockHold | None:
        """The holding of ``key`` by ``worker_id``, or None (also when the worker is not alive)."""
        with self._lock:
            if not self._registry.is_alive(worker_id):
                return None
            return self._worker_blocks.get(worker_id, {}).get(key)

    def stored_events(self) -> list[BlockEvent]:
        """One ``STORED`` event per block of every alive worker, to replay into another index."""
        with self._lock:
            return [
                BlockEvent.stored(worker_id, key, hold.tier, hold.has_snapshot)
                for worker_id in self._registry.alive_ids()
                for key, hold in sorted(self._worker_blocks.get(worker_id, {}).items())
            ]

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the rows and the per-worker maps disagree, a slot is
        shared or dangling, or a block is held by an unknown worker."""
        with self._lock:
            self._registry.check_integrity()
            known = self._registry.known_ids()
            assert self._slots.keys() == self._worker_blocks.keys(), "slots and block holders differ"
            used = sorted(self._slots.values())
            assert len(set(used)) == len(used), f"shared slots {used}"
            assert set(used).isdisjoint(self._free_slots), f"slots {used} also free {self._free_slots}"
            assert all(0 <= s < self._width for s in used + self._free_slots), f"slots beyond {self._width}"
            num_pairs = 0
            for worker_id, held in self._worker_blocks.items():
                assert held, f"empty block set left for {worker_id}"
                assert worker_id in known, f"blocks held by unregistered worker {worker_id}"
                slot = self._slots[worker_id]
                for key, hold in held.items():
                    row = self._rows.get(key)
                    assert row is not None and row[slot] == hold.code, (worker_id, key.hex())
                num_pairs += len(held)
            for key, row in self._rows.items():
                assert len(row) == self._width and any(row), f"row of {key.hex()}: {bytes(row)!r}"
            assert num_pairs == sum(len(row) - row.count(0) for row in self._rows.values()), "block maps differ"

    def _worker_match_locked(self, worker_id: str, matrix: bytes) -> WorkerMatch:
        """One worker's column of ``matrix`` up to its first 0: the contiguous held prefix."""
        slot = self._slots.get(worker_id)
        if slot is None:  # holds nothing: one frozen answer per worker (decode workers never hold)
            empty = self._empty_matches.get(worker_id)
            if empty is None:
                empty = self._empty_matches[worker_id] = WorkerMatch(worker_id, 0, 0, b"")
            return empty
        column = matrix[slot :: self._width]
        num_present = column.find(0)
        codes = column if num_present < 0 else column[:num_present]
        num_usable = usable_length(codes.translate(_SNAPSHOT_OF_CODE))
        return WorkerMatch(worker_id, len(codes), num_usable, codes.translate(_TIER_OF_CODE))

    def _slot_locked(self, worker_id: str) -> int:
        slot = self._slots.get(worker_id)
        if slot is not None:
            return slot
        if not self._free_slots:
            old = self._width
            self._width *= 2
            for row in self._rows.values():
                row.extend(bytes(old))
            self._free_slots = list(range(self._width - 1, old - 1, -1))
        self._slots[worker_id] = slot = self._free_slots.pop()
        return slot

    def _store_locked(self, worker_id: str, key: BlockKey, hold: BlockHold) -> None:
        slot = self._slot_locked(worker_id)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = bytearray(self._width)
        row[slot] = hold.code
        self._worker_blocks.setdefault(worker_id, {})[key] = hold

    def _drop_locked(self, worker_id: str, key: BlockKey) -> None:
        held = self._worker_blocks.get(worker_id)
        if held is None or held.pop(key, None) is None:
            return
        self._clear_locked(self._slots[worker_id], key)
        if not held:
            del self._worker_blocks[worker_id]
            self._free_slots.append(self._slots.pop(worker_id))

    def _clear_locked(self, slot: int, key: BlockKey) -> None:
        row = self._rows[key]
        row[slot] = 0
        if row.count(0) == len(row):  # nobody holds it any more
            del self._rows[key]

    def _purge_blocks_locked(self, worker_id: str) -> None:
        self._empty_matches.pop(worker_id, None)
        held = self._worker_blocks.pop(worker_id, None)
        if held is None:
            return
        slot = self._slots.pop(worker_id)
        for key in held:
            self._clear_locked(slot, key)
        self._free_slots.append(slot)

    def _reap_locked(self) -> tuple[str, ...]:
        expired = self._registry.reap_expired()
        for worker_id in expired:
            self._purge_blocks_locked(worker_id)
        return tuple(expired)
