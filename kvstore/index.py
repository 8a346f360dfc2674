"""The block index's values: block events, and what a match of a key sequence answers.

``BlockEvent`` is one change of one worker's holding of one block (the prefill worker's store
emits them; ``kvstore.block_index.BlockIndex`` applies them). ``MatchSnapshot`` answers, per
worker, the contiguous held prefix of a key sequence and the usable prefix under the hybrid
hit rule (DESIGN.md section 3, ``kvstore.hitrule``): the deepest ``i`` such that the worker
holds ``keys[0:i]`` and ``keys[i-1]`` carries a KDA snapshot on that worker.

    keys:        k0    k1    k2    k3    k4
    held by w:   DRAM  DEV   DRAM  SSD   -      -> num_blocks_present = 4
    snapshot:    no    yes   no    no           -> num_blocks_usable  = 2 (prefix k0..k1)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from kvstore.blocks import KEY_BYTES, BlockKey, Tier

_SLOWEST_FIRST = tuple((t, int(t)) for t in sorted(Tier, reverse=True))


class BlockEventKind(enum.StrEnum):
    STORED = "stored"
    REMOVED = "removed"


def check_key(key: BlockKey) -> None:
    """Raise ``ValueError`` unless ``key`` is a ``KEY_BYTES``-long ``bytes``."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"block key must be {KEY_BYTES} bytes, got {key!r}")


def check_keys(keys: Sequence[BlockKey]) -> None:
    """``check_key`` of every key; the common case (all valid) runs in C."""
    if set(map(type, keys)) - {bytes} or set(map(len, keys)) - {KEY_BYTES}:
        for key in keys:
            check_key(key)  # raises, naming the bad key


@dataclasses.dataclass(frozen=True, slots=True)
class BlockEvent:
    """One change of one worker's holding of one block; ``tier`` is None exactly when removed."""

    worker_id: str
    key: BlockKey
    tier: Tier | None
    has_snapshot: bool
    kind: BlockEventKind

    def __post_init__(self) -> None:
        check_key(self.key)
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")
        if (self.kind is BlockEventKind.STORED) != (self.tier is not None):
            raise ValueError(f"a {self.kind} event needs tier {'set' if self.tier is None else 'None'}")
        if self.kind is BlockEventKind.REMOVED and self.has_snapshot:
            raise ValueError("a removed event carries no snapshot")

    @classmethod
    def stored(cls, worker_id: str, key: BlockKey, tier: Tier, has_snapshot: bool = False) -> BlockEvent:
        return cls(worker_id, key, Tier(tier), has_snapshot, BlockEventKind.STORED)

    @classmethod
    def removed(cls, worker_id: str, key: BlockKey) -> BlockEvent:
        return cls(worker_id, key, None, False, BlockEventKind.REMOVED)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerMatch:
    """How much of a key sequence one worker holds. ``tiers[i]`` is the ``Tier`` value of
    ``keys[i]`` as one byte (a 1,000-block match is one ``bytes``, not 1,000 objects); any
    sequence of tiers given is stored that way, so ``WorkerMatch(w, 2, 2, (DRAM, SSD))`` equals
    the index's answer and ``tiers[i] == Tier.SSD`` holds (``Tier`` is an ``IntEnum``)."""

    worker_id: str
    num_blocks_present: int
    num_blocks_usable: int
    tiers: bytes

    def __post_init__(self) -> None:
        if type(self.tiers) is not bytes:
            object.__setattr__(self, "tiers", bytes(self.tiers))
        assert 0 <= self.num_blocks_usable <= self.num_blocks_present == len(self.tiers), self

    @property
    def slowest_usable_tier(self) -> Tier | None:
        """The slowest tier within the usable prefix, or None when nothing is usable."""
        for tier, value in _SLOWEST_FIRST:
            if self.tiers.find(value, 0, self.num_blocks_usable) >= 0:
                return tier
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class MatchSnapshot:
    """Per alive worker (sorted by id, zero matches included), the match of ``num_keys`` keys;
    ``held``: those that hold a block (in the same order), what a reader that skips the zero
    matches needs (most workers of a large cluster hold no prefix of a request). Made from
    ``matches`` when not given; not compared (it follows from them)."""

    num_keys: int
    matches: tuple[WorkerMatch, ...]
    held: tuple[WorkerMatch, ...] = dataclasses.field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.held is None:
            object.__setattr__(self, "held", tuple(m for m in self.matches if m.num_blocks_present))

    def get(self, worker_id: str) -> WorkerMatch | None:
        """The match of ``worker_id``, or None when that worker is not alive."""
        return next((m for m in self.matches if m.worker_id == worker_id), None)
