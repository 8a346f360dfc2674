"""DRAM tier: a bounded host pool of encoded block payloads.

Holds each block as its immutable encoded bytes (``payload_format.encode``), so a block can be
served to a peer or written to SSD without re-encoding, and one checksum covers it on every
path. Its size is the encoded length. Not thread-safe: used under the store's lock.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.blocks import BlockKey, Tier
from kvstore.ledger import TierLedger
from kvstore.payload_format import read_header


class DramTier:
    """Encoded payloads in host memory, at most ``capacity_bytes`` of them."""

    tier = Tier.DRAM

    def __init__(self, capacity_bytes: int) -> None:
        self.ledger = TierLedger("dram", capacity_bytes)
        self._blocks: dict[BlockKey, bytes] = {}

    @property
    def sizes_bytes(self) -> Mapping[BlockKey, int]:
        return self.ledger.sizes_bytes

    def put(self, key: BlockKey, encoded: bytes) -> None:
        """Keep ``encoded`` (checked header; the caller vouches for the body). ValueError when
        the key is present or the bytes do not fit: the caller makes room first."""
        head = read_header(encoded)
        self.ledger.add(key, len(encoded), head.has_snapshot)
        self._blocks[key] = encoded

    def try_get(self, key: BlockKey) -> bytes | None:
        """The encoded payload, or None when absent. Never copies."""
        return self._blocks.get(key)

    def remove(self, key: BlockKey) -> int:
        """Drop a block; returns the bytes freed (0 when absent)."""
        self._blocks.pop(key, None)
        return self.ledger.discard(key)

    def check_integrity(self) -> None:
        self.ledger.check_integrity()
        if self._blocks.keys() != self.ledger.sizes_bytes.keys():
            raise AssertionError("dram: blocks and ledger disagree on keys")
        for key, blob in self._blocks.items():
            if len(blob) != self.ledger.sizes_bytes[key]:
                raise AssertionError(f"dram: {key.hex()} holds {len(blob)} bytes, ledger says otherwise")
