"""Block keys from a trace's hash ids, without tokens.

Cluster block ``j`` of a prompt is sub-block ``j % k`` of trace block ``hash_ids[j // k]``
(``k = blocks_per_trace_block``, see ``replay.transform.ReplayRequest``). Its key chains
the parent key with (hash id, sub-block, tenant) through BLAKE2b-128, like
``kvstore.blocks.block_key`` chains tokens: two prompts share exactly the keys of their
shared leading blocks, and the hit rule and eviction see the trace's real reuse.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvstore.blocks import KEY_BYTES, ROOT_KEY

_HASHER = hashlib.blake2b(digest_size=KEY_BYTES, person=b"tidekv-sim")  # copied per key: cheaper than a new one


class KeyCache:
    """Memoised keys: a shared prefix is hashed once while it is in use. At most
    ``2 * (max_keys + the longest chain)`` are held, whatever the trace's length: two
    generations, the newer taking every key used; when it fills (checked after each chain) it
    becomes the older and the older is forgotten, so a key used in the last ``max_keys``
    stays. (A key is a pure function of its chain: forgetting one only costs hashing it again.)

    A chain is looked up from its first block until a block is in neither generation; the
    rest is hashed without looking: a child is only ever memoised in the same chain as its
    parent, just after it, so a parent that is not memoised has no memoised children."""

    def __init__(self, max_keys: int = 1 << 16) -> None:  # ~230 bytes a key: two generations, ~30 MiB
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._new: dict[tuple[bytes, int, int, str], bytes] = {}
        self._old: dict[tuple[bytes, int, int, str], bytes] = {}

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def key(self, parent: bytes, hash_id: int, sub_block: int, tenant: str) -> bytes:
        """The key of one block after ``parent`` (memoised like a chain's)."""
        memo = (parent, hash_id, sub_block, tenant)
        key = self._new.get(memo) or self._old.get(memo) or _hash(parent, hash_id, sub_block, tenant)
        self._new[memo] = key
        self._age()
        return key

    def _age(self) -> None:
        if len(self._new) >= self.max_keys:
            self._old, self._new = self._new, {}

    def chain(self, hash_ids: Sequence[int], num_full_blocks: int, blocks_per_trace_block: int,
              tenant: str = "") -> tuple[bytes, ...]:
        """Keys of the prompt's ``num_full_blocks`` full cluster blocks."""
        if num_full_blocks > len(hash_ids) * blocks_per_trace_block:
            raise ValueError(f"{num_full_blocks} blocks but only {len(hash_ids)} hash ids of "
                             f"{blocks_per_trace_block} blocks each")
        k, new, old = blocks_per_trace_block, self._new, self._old
        out: list[bytes] = []
        parent, j = ROOT_KEY, 0
        if k == 1:  # the usual case, without the index arithmetic: block j is sub-block 0 of hash id j
            for hash_id in hash_ids[:num_full_blocks]:  # the memoised part
                memo = (parent, hash_id, 0, tenant)
                key = new.get(memo)
                if key is None:
                    key = old.get(memo)
                    if key is None:
                        break
                    new[memo] = key
                out.append(key)
                parent = key
            j = len(out)
        else:
            while j < num_full_blocks:  # the memoised part
                memo = (parent, hash_ids[j // k], j % k, tenant)
                key = new.get(memo)
                if key is None:
                    key = old.get(memo)
                    if key is None:
                        break
                    new[memo] = key
                out.append(key)
                parent, j = key, j + 1
        for i in range(j, num_full_blocks):  # the rest: new to the cache
            hash_id, sub_block = hash_ids[i // k], i % k
            key = _hash(parent, hash_id, sub_block, tenant)
            new[(parent, hash_id, sub_block, tenant)] = key
            out.append(key)
            parent = key
        self._age()
        return tuple(out)


def _hash(parent: bytes, hash_id: int, sub_block: int, tenant: str) -> bytes:
    h = _HASHER.copy()
    h.update(parent)
    h.update(f"{hash_id}/{sub_block}/{tenant}".encode())
    return h.digest()
