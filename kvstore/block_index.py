"""Block holdings per worker, matched against a key sequence (the cluster state's index;
``clusterstate.state.ClusterState`` owns one, with the registry beside it).

Owns ``worker_id -> {key: BlockHold}`` (what each worker holds; dropping a worker takes time
proportional to its own blocks) and its mirror for matching, ``key -> row``. A worker that
holds blocks has a *slot*, a column of every row: the byte ``row[slot]`` is 0 where the
worker does not hold the key, else ``1 + 2 * tier + snapshot``. A match looks each key up
once and cuts one column per worker out of the joined rows, so the per-block work is C (dict
lookups, ``bytes`` slicing and ``translate``), never a Python object per block::

    rows (width 4)   slot 0  1  2  3          matrix = b"".join(rows)
    keys[0]               3  4  0  0          column of slot 1 = matrix[1::4] = 4 3 4
    keys[1]               4  3  0  0          -> 3 blocks present; 4 = 1 + 2*DRAM + snapshot,
    keys[2]               0  4  0  0             so the last snapshot ends block 2: usable 3
    keys[3]               (no row: held by nobody, the scan stops here)

Only a worker holding ``keys[0]`` can have a prefix: a match cuts the columns of the slots
non-zero in the first row (found in C) into a copy of the answer's frozen empty matches (kept
while the workers asked for are the same), and names those holders in ``MatchSnapshot.held``,
so on a large cluster a match costs its holders, not a call per worker.

The usable length is ``kvstore.hitrule``'s. Slots are reused once their worker holds
nothing; rows widen (doubling) when a new slot does not fit. Not thread-safe: the owner locks.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import re
from collections.abc import Iterable, Sequence

from kvstore.blocks import BlockKey, Tier
from kvstore.hitrule import usable_length
from kvstore.index import BlockEvent, BlockEventKind, MatchSnapshot, WorkerMatch, check_keys

assert 2 * max(Tier) + 2 < 256, "a row byte holds 1 + 2 * tier + snapshot"
_MIN_WIDTH = 16  # slots a row has at first; doubled when a new one does not fit
# Row byte -> the tier / the snapshot flag it encodes (bytes.translate tables; 0 -> 0).
_TIER_OF_CODE = bytes((c - 1) // 2 if 0 < c <= 2 * len(Tier) else 0 for c in range(256))
_SNAPSHOT_OF_CODE = bytes((c - 1) % 2 if 0 < c <= 2 * len(Tier) else 0 for c in range(256))
_HELD = re.compile(rb"[^\x00]")  # a non-zero row byte: a slot that holds the key


@dataclasses.dataclass(frozen=True, slots=True)
class BlockHold:
    """One worker's holding of one block."""

    tier: Tier
    has_snapshot: bool

    @property
    def code(self) -> int:
        """The row byte of this holding (see the module docstring)."""
        return 1 + 2 * int(self.tier) + int(self.has_snapshot)

    @classmethod
    def of_code(cls, code: int) -> BlockHold:
        return cls(Tier(_TIER_OF_CODE[code]), bool(_SNAPSHOT_OF_CODE[code]))


# Every holding there can be, made once (they are frozen values): an event takes its own.
_HOLDS = {(tier, snapshot): BlockHold(tier, snapshot) for tier in Tier for snapshot in (False, True)}


class BlockIndex:
    """Block holdings per worker; see the module docstring."""

    def __init__(self) -> None:
        self._worker_blocks: dict[str, dict[BlockKey, BlockHold]] = {}
        self._rows: dict[BlockKey, bytearray] = {}  # the same holdings, by key: one byte per slot
        self._slots: dict[str, int] = {}  # exactly the workers of _worker_blocks
        self._owners: dict[int, str] = {}  # the same, by slot
        self._width = _MIN_WIDTH  # bytes in every row
        self._free_slots = list(range(self._width - 1, -1, -1))  # pop(): the last freed, else lowest unused
        self._empty_matches: dict[str, WorkerMatch] = {}  # made once per worker; forgotten with it
        # The last ``worker_ids`` matched against, with every one's empty match and its position.
        self._last_empties: tuple[list[str], tuple[WorkerMatch, ...], dict[str, int]] = ([], (), {})

    def apply(self, event: BlockEvent) -> None:
        """One worker's stored (or moved) or removed block."""
        if event.kind is BlockEventKind.STORED:
            assert event.tier is not None
            self._store(event.worker_id, event.key, _HOLDS[(event.tier, event.has_snapshot)])
        else:
            self._drop(event.worker_id, event.key)

    def apply_store_events(self, worker_id: str, events: Iterable) -> None:
        """One worker's ``kvstore.placement.StoreEvent``s in order, as ``apply`` applies their
        ``BlockEvent``s ("stored" and "moved" set the holding, "removed" drops it)."""
        store, drop = self._store, self._drop
        for e in events:
            if e.kind == "removed":
                drop(worker_id, e.key)
            else:
                store(worker_id, e.key, _HOLDS[(e.tier, e.has_snapshot)])

    def match(self, keys: Sequence[BlockKey], worker_ids: Iterable[str]) -> MatchSnapshot:
        """Per worker of ``worker_ids`` (sorted), its held and usable prefix of ``keys``."""
        # Rows up to the first key nobody holds (every prefix ends there), as one matrix.
        try:
            rows = list(itertools.takewhile(operator.truth, map(self._rows.get, keys)))
        except TypeError:  # an unhashable key: the check below names it
            rows = []
        check_keys(keys[len(rows) :])  # the keys found were checked when they were stored
        empties, position = self._empties(worker_ids)
        if not rows:
            return MatchSnapshot(len(keys), empties, ())
        matrix, owners = b"".join(rows), self._owners
        held = sorted((position[w], w, m.start()) for m in _HELD.finditer(rows[0])
                      if (w := owners[m.start()]) in position)  # by position in the answer, with its slot
        matches, column = list(empties), self._column_match
        for i, w, slot in held:
            matches[i] = column(w, slot, matrix)
        return MatchSnapshot(len(keys), tuple(matches), tuple(matches[i] for i, _, _ in held))

    def drop_worker(self, worker_id: str) -> None:
        """Forget every block ``worker_id`` holds."""
        self._empty_matches.pop(worker_id, None)
        self._last_empties = ([], (), {})
        held = self._worker_blocks.pop(worker_id, None)
        if held is None:
            return
        slot = self._slots.pop(worker_id)
        del self._owners[slot]
        for key in held:
            self._clear(slot, key)
        self._free_slots.append(slot)

    def holdings(self, worker_id: str) -> dict[BlockKey, BlockHold]:
        """What ``worker_id`` holds (a copy)."""
        return dict(self._worker_blocks.get(worker_id, {}))

    def holders(self) -> list[str]:
        return sorted(self._worker_blocks)

    def check_integrity(self, known_ids: set[str]) -> None:
        """Raise ``AssertionError`` if the rows and the per-worker maps disagree, a slot is
        shared or dangling, or a block is held by a worker not in ``known_ids``."""
        assert self._slots.keys() == self._worker_blocks.keys(), "slots and block holders differ"
        assert self._owners == {slot: w for w, slot in self._slots.items()}, "slot owners differ"
        used = sorted(self._slots.values())
        assert len(set(used)) == len(used), f"shared slots {used}"
        assert set(used).isdisjoint(self._free_slots), f"slots {used} also free {self._free_slots}"
        assert all(0 <= s < self._width for s in used + self._free_slots), f"slots beyond {self._width}"
        num_pairs = 0
        for worker_id, held in self._worker_blocks.items():
            assert held, f"empty block set left for {worker_id}"
            assert worker_id in known_ids, f"blocks held by unregistered worker {worker_id}"
            slot = self._slots[worker_id]
            for key, hold in held.items():
                row = self._rows.get(key)
                assert row is not None and row[slot] == hold.code, (worker_id, key.hex())
            num_pairs += len(held)
        for key, row in self._rows.items():
            assert len(row) == self._width and any(row), f"row of {key.hex()}: {bytes(row)!r}"
        assert num_pairs == sum(len(row) - row.count(0) for row in self._rows.values()), "block maps differ"

    def _empties(self, worker_ids: Iterable[str]) -> tuple[tuple[WorkerMatch, ...], dict[str, int]]:
        """Every worker's empty match, in the order of ``worker_ids``, and each one's position
        there: kept while a match asks for the same workers (a registry's alive ids change
        rarely, and comparing two lists of the same strings is a pass in C)."""
        ids = worker_ids if isinstance(worker_ids, list) else list(worker_ids)
        last_ids, empties, position = self._last_empties
        if ids != last_ids:
            empties = tuple(map(self._empty_match, ids))
            position = {w: i for i, w in enumerate(ids)}
            self._last_empties = (list(ids), empties, position)  # a copy: the caller's list may change
        return empties, position

    def _empty_match(self, worker_id: str) -> WorkerMatch:
        """The answer for a worker that does not hold the first key (or holds nothing: decode
        workers never do): one frozen value per worker, the one its column would give."""
        empty = self._empty_matches.get(worker_id)
        if empty is None:
            empty = self._empty_matches[worker_id] = WorkerMatch(worker_id, 0, 0, b"")
        return empty

    def _column_match(self, worker_id: str, slot: int, matrix: bytes) -> WorkerMatch:
        """The column of ``slot`` (``worker_id``'s, non-zero in the first row) of ``matrix`` up
        to its first 0: the contiguous held prefix."""
        column = matrix[slot :: self._width]
        num_present = column.find(0)
        codes = column if num_present < 0 else column[:num_present]
        num_usable = usable_length(codes.translate(_SNAPSHOT_OF_CODE))
        return WorkerMatch(worker_id, len(codes), num_usable, codes.translate(_TIER_OF_CODE))

    def _slot(self, worker_id: str) -> int:
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
        self._owners[slot] = worker_id
        return slot

    def _store(self, worker_id: str, key: BlockKey, hold: BlockHold) -> None:
        slot = self._slot(worker_id)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = bytearray(self._width)
        row[slot] = hold.code
        self._worker_blocks.setdefault(worker_id, {})[key] = hold

    def _drop(self, worker_id: str, key: BlockKey) -> None:
        held = self._worker_blocks.get(worker_id)
        if held is None or held.pop(key, None) is None:
            return
        self._clear(self._slots[worker_id], key)
        if not held:
            del self._worker_blocks[worker_id]
            slot = self._slots.pop(worker_id)
            del self._owners[slot]
            self._free_slots.append(slot)

    def _clear(self, slot: int, key: BlockKey) -> None:
        row = self._rows[key]
        row[slot] = 0
        if row.count(0) == len(row):  # nobody holds it any more
            del self._rows[key]
