"""Byte accounting for one tier: which keys it holds, their sizes, their snapshot flags.

Every tier (device, DRAM, SSD) owns one ``TierLedger``; the ledger refuses an insert that
would pass the capacity (a ValueError: the caller should have made room first), so a tier's
capacity can never be exceeded. Not thread-safe; tiers are used under the store's lock.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from kvstore.blocks import BlockKey


class TierLedger:
    """Sizes in bytes of the keys of one tier, bounded by ``capacity_bytes``."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{name}: capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._sizes: dict[BlockKey, int] = {}
        self._snapshots: set[BlockKey] = set()
        self.sizes_bytes: Mapping[BlockKey, int] = types.MappingProxyType(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def fits(self, size_bytes: int) -> bool:
        return size_bytes <= self.free_bytes

    def has_snapshot(self, key: BlockKey) -> bool:
        return key in self._snapshots

    def add(self, key: BlockKey, size_bytes: int, has_snapshot: bool) -> None:
        """Record a new key. ValueError if it is already here or would pass the capacity."""
        if key in self._sizes:
            raise ValueError(f"{self.name}: key {key.hex()} already present")
        if size_bytes > self.capacity_bytes - self.used_bytes:  # not self.fits(size_bytes), inline: per block
            raise ValueError(
                f"{self.name}: {size_bytes} bytes do not fit, {self.used_bytes} of {self.capacity_bytes} used"
            )
        self._sizes[key] = size_bytes
        self.used_bytes += size_bytes
        if has_snapshot:
            self._snapshots.add(key)

    def discard(self, key: BlockKey) -> int:
        """Forget a key; returns the bytes freed (0 when it was absent)."""
        size_bytes = self._sizes.pop(key, 0)
        self.used_bytes -= size_bytes
        self._snapshots.discard(key)
        return size_bytes

    def check_integrity(self) -> None:
        """Raise AssertionError when the accounting is broken."""
        total = sum(self._sizes.values())
        if total != self.used_bytes:
            raise AssertionError(f"{self.name}: used_bytes {self.used_bytes} != sum of sizes {total}")
        if self.used_bytes > self.capacity_bytes:
            raise AssertionError(f"{self.name}: {self.used_bytes} bytes used > capacity {self.capacity_bytes}")
        if any(size <= 0 for size in self._sizes.values()):
            raise AssertionError(f"{self.name}: a key has a non-positive size")
        if not self._snapshots <= self._sizes.keys():
            raise AssertionError(f"{self.name}: snapshot flags for keys not held")
