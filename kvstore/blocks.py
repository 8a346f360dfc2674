"""Block identity: chained block keys and storage tiers.

A block is ``block_size`` consecutive prompt tokens. Its key is a 16-byte BLAKE2b digest of
``(parent key, the block's token ids, model fingerprint, cache salt)``, so the key of block i
names the whole prefix [0, (i+1)*block_size). The hash is stable across processes and
machines (never Python's ``hash()``); different salts or models never share keys.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence

BlockKey = bytes
"""16-byte digest naming a prefix of whole blocks; ``key.hex()`` is its text form."""

KEY_BYTES = 16
ROOT_KEY: BlockKey = bytes(KEY_BYTES)


class Tier(enum.IntEnum):
    """Where a block lives; lower is faster. Eviction demotes to the next higher value."""

    DEVICE = 0
    DRAM = 1
    SSD = 2


def block_key(
    parent: BlockKey, token_ids: Sequence[int], model_fingerprint: str, cache_salt: str = ""
) -> BlockKey:
    """Key of one block given its parent's key (``ROOT_KEY`` for the first block)."""
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"tidekv-block-v1")
    fp = model_fingerprint.encode()
    salt = cache_salt.encode()
    # Length-prefix every variable field so no two tuples serialise to the same bytes.
    h.update(parent)
    h.update(struct.pack("<I", len(fp)) + fp)
    h.update(struct.pack("<I", len(salt)) + salt)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def chain_keys(
    token_ids: Sequence[int], block_size: int, model_fingerprint: str, cache_salt: str = ""
) -> list[BlockKey]:
    """Keys of every *full* block of ``token_ids``; a trailing partial block has no key."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[BlockKey] = []
    parent = ROOT_KEY
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size], model_fingerprint, cache_salt)
        keys.append(parent)
    return keys
