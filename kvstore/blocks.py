"""Block identity: chained block keys and storage tiers.

A block is ``block_size`` consecutive prompt tokens. Its key is a 16-byte BLAKE2b digest of
``(parent key, the block's token ids, model fingerprint, cache salt)``, so the key of block i
names the whole prefix [0, (i+1)*block_size). The hash is stable across processes and
machines (never Python's ``hash()``); different salts or models never share keys. A live
cluster keys the hash (BLAKE2b's ``key``) with a key derived from its cluster secret
(``runtime.auth.derive(secret, "block-keys")``): the keys stay the same in every process of the
cluster, but one seen in the index or the store tells nobody without the secret which prompt
it names (guessing a prompt and hashing it gives another key). Without a key (tests, the
simulator, a calibration's own store) the hash is unkeyed.
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


_PERSON = b"tidekv-block-v1"


def _middle(model_fingerprint: str, cache_salt: str, num_tokens: int) -> bytes:
    """The bytes between a block's parent key and its token ids. Every variable field is
    length-prefixed so that no two tuples serialise to the same bytes."""
    fp, salt = model_fingerprint.encode(), cache_salt.encode()
    return struct.pack("<I", len(fp)) + fp + struct.pack("<I", len(salt)) + salt + struct.pack("<I", num_tokens)


def block_key(
    parent: BlockKey, token_ids: Sequence[int], model_fingerprint: str, cache_salt: str = "", key: bytes = b""
) -> BlockKey:
    """Key of one block given its parent's key (``ROOT_KEY`` for the first block)::

        BLAKE2b-128(person="tidekv-block-v1", parent | u32 len fp | fp | u32 len salt | salt
                    | u32 num tokens | int64 token ids, little-endian)
    """
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON, key=key)
    h.update(parent + _middle(model_fingerprint, cache_salt, len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def chain_keys(
    token_ids: Sequence[int], block_size: int, model_fingerprint: str, cache_salt: str = "", key: bytes = b""
) -> list[BlockKey]:
    """Keys of every *full* block of ``token_ids``; a trailing partial block has no key.
    The same keys as ``block_key`` block by block, with the tokens packed once and each block
    hashed from a copy of one configured hasher (a 1,000-block prompt is most of a routing
    decision otherwise)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_tokens = len(token_ids) // block_size * block_size
    packed = struct.pack(f"<{num_tokens}q", *token_ids[:num_tokens])
    middle, step = _middle(model_fingerprint, cache_salt, block_size), 8 * block_size
    base = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON, key=key)
    keys: list[BlockKey] = []
    parent = ROOT_KEY
    for start in range(0, len(packed), step):
        h = base.copy()
        h.update(parent + middle + packed[start : start + step])
        parent = h.digest()
        keys.append(parent)
    return keys
