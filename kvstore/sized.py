"""A tier that accounts blocks by size without holding their bytes: the simulator's stand-in
for DRAM or SSD, so a simulated worker runs the real ``Placement`` (eviction policies,
demotion, promotion, pins, events) over capacities in bytes.

A block is a ``SizedBlob`` (its size and whether it carries a KDA snapshot), and the ledger
already holds both, so the tier keeps nothing else per block: ``try_get`` hands back an equal
blob (one shared value per size and kind). Not thread-safe, like every tier.
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


_MAX_SHARED_BLOBS = 256  # distinct (size, kind) values kept as shared blobs; a simulator uses a few


class SizedTier:
    def __init__(self, tier: Tier, capacity_bytes: int) -> None:
        self.tier = tier
        self.ledger = TierLedger(f"sized-{tier.name.lower()}", capacity_bytes)
        self._sizes = self.ledger.sizes_bytes
        self._shared: dict[tuple[int, bool], SizedBlob] = {}

    @property
    def sizes_bytes(self) -> Mapping[BlockKey, int]:
        return self.ledger.sizes_bytes

    def put(self, key: BlockKey, blob: SizedBlob) -> None:
        """ValueError when present or over capacity (the caller makes room first)."""
        self.ledger.add(key, blob.size_bytes, blob.has_snapshot)
        if len(self._shared) < _MAX_SHARED_BLOBS:
            self._shared.setdefault((blob.size_bytes, blob.has_snapshot), blob)

    def try_get(self, key: BlockKey) -> SizedBlob | None:
        size_bytes = self._sizes.get(key)
        if size_bytes is None:
            return None
        kind = (size_bytes, self.ledger.has_snapshot(key))
        blob = self._shared.get(kind)
        return blob if blob is not None else SizedBlob(*kind)

    def remove(self, key: BlockKey) -> int:
        return self.ledger.discard(key)

    def check_integrity(self) -> None:
        self.ledger.check_integrity()
