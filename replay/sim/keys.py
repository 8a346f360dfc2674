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


class KeyCache:
    """Memoised keys: a shared prefix is hashed once for the whole trace."""

    def __init__(self) -> None:
        self._keys: dict[tuple[bytes, int, int, str], bytes] = {}

    def key(self, parent: bytes, hash_id: int, sub_block: int, tenant: str) -> bytes:
        memo = (parent, hash_id, sub_block, tenant)
        key = self._keys.get(memo)
        if key is None:
            h = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=b"tidekv-sim")
            h.update(f"{hash_id}/{sub_block}/{tenant}".encode())
            key = self._keys[memo] = h.digest()
        return key

    def chain(self, hash_ids: Sequence[int], num_full_blocks: int, blocks_per_trace_block: int,
              tenant: str = "") -> tuple[bytes, ...]:
        """Keys of the prompt's ``num_full_blocks`` full cluster blocks."""
        if num_full_blocks > len(hash_ids) * blocks_per_trace_block:
            raise ValueError(f"{num_full_blocks} blocks but only {len(hash_ids)} hash ids of "
                             f"{blocks_per_trace_block} blocks each")
        out, parent = [], ROOT_KEY
        for j in range(num_full_blocks):
            parent = self.key(parent, hash_ids[j // blocks_per_trace_block], j % blocks_per_trace_block, tenant)
            out.append(parent)
        return tuple(out)
