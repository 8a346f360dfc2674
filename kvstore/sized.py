"""A tier that accounts blocks by size without holding their bytes: the simulator's stand-in
for DRAM or SSD, so a simulated worker runs the real ``Placement`` (eviction policies,
demotion, promotion, pins, events) over capacities in bytes.

A block is a ``SizedBlob`` (its size and whether it carries a KDA snapshot). Not
thread-safe, like every tier.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvstore.blocks import BlockKey, Tier
from kvstore.ledger import TierLedger


@dataclass(frozen=True, slots=True)
class SizedBlob:
    size_bytes: int
    has_snapshot: bool


class SizedTier:
    def __init__(self, tier: Tier, capacity_bytes: int) -> None:
        self.tier = tier
        self.ledger = TierLedger(f"sized-{tier.name.lower()}", capacity_bytes)
        self._blobs: dict[BlockKey, SizedBlob] = {}

    @property
    def sizes_bytes(self) -> Mapping[BlockKey, int]:
        return self.ledger.sizes_bytes

    def put(self, key: BlockKey, blob: SizedBlob) -> None:
        """ValueError when present or over capacity (the caller makes room first)."""
        self.ledger.add(key, blob.size_bytes, blob.has_snapshot)
        self._blobs[key] = blob

    def try_get(self, key: BlockKey) -> SizedBlob | None:
        return self._blobs.get(key)

    def remove(self, key: BlockKey) -> int:
        self._blobs.pop(key, None)
        return self.ledger.discard(key)

    def check_integrity(self) -> None:
        self.ledger.check_integrity()
        if self._blobs.keys() != self.ledger.sizes_bytes.keys():
            raise AssertionError(f"{self.ledger.name}: blobs and ledger disagree on keys")
