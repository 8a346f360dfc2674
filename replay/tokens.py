"""Deterministic token materialisation: a trace hash id becomes the same block of token ids in
every run and every process.

Each hash id seeds its own numpy ``Generator`` from BLAKE2b(``SEED_DOMAIN`` + the id), never
from Python's ``hash()`` (salted per process). A prompt is the concatenation of its ids'
blocks, cut at its length::

    hash_ids   [  7  ][  8  ][  9  ]          one id = tokens_per_block tokens
    prompt A   [  7  ][  8  ][  9  ]
    prompt B   [  7  ][  8  ][ 4 ]            a shorter last block is the id's block cut short
    prompt C   [  7  ][ 12  ]

so A and B share exactly ``2 * tokens_per_block + 4`` leading tokens, A and C exactly one
block, and the cluster's real prefix cache sees the trace's real reuse.

Token ids are drawn uniformly from ``1 .. vocab_size-1`` without ``reserved_ids`` (0 and the
byte tokenizer's BOS=256/EOS=257 for the tiny model), so no drawn id is a special token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

SEED_DOMAIN = b"tidekv.replay.block:"
# engine.tokenizer.CharTokenizer's BOS and EOS, plus 0; written here so that the replay client
# does not import the engine (torch). tests/replay checks them against the tokenizer.
DEFAULT_RESERVED_IDS = (0, 256, 257)
DEFAULT_VOCAB_SIZE = 8192  # the built-in tiny model's


def block_seed(hash_id: int) -> int:
    """The 64-bit seed of one hash id: the first 8 bytes of BLAKE2b over the id's decimal form."""
    digest = hashlib.blake2b(SEED_DOMAIN + str(int(hash_id)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@lru_cache(maxsize=8)
def _alphabet(vocab_size: int, reserved_ids: tuple[int, ...]) -> np.ndarray:
    allowed = np.setdiff1d(np.arange(1, vocab_size, dtype=np.int64), np.asarray(reserved_ids, dtype=np.int64))
    if allowed.size == 0:
        raise ValueError(f"no token ids left in 1..{vocab_size - 1} after removing {reserved_ids}")
    return allowed


@lru_cache(maxsize=65536)
def block_tokens(hash_id: int, tokens_per_block: int, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 reserved_ids: tuple[int, ...] = DEFAULT_RESERVED_IDS) -> tuple[int, ...]:
    """The ``tokens_per_block`` token ids of one hash id; the same in every process. Cached."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    alphabet = _alphabet(vocab_size, tuple(sorted(reserved_ids)))
    rng = np.random.Generator(np.random.PCG64(block_seed(hash_id)))
    picks = rng.integers(0, alphabet.size, size=tokens_per_block)
    return tuple(int(t) for t in alphabet[picks])


def prompt_tokens(hash_ids: Sequence[int], prompt_len: int, tokens_per_block: int,
                  vocab_size: int = DEFAULT_VOCAB_SIZE,
                  reserved_ids: tuple[int, ...] = DEFAULT_RESERVED_IDS) -> tuple[int, ...]:
    """The first ``prompt_len`` tokens of the chain ``hash_ids``; ValueError when the chain is
    too short to cover them."""
    num_blocks = -(-prompt_len // tokens_per_block)
    if prompt_len < 1 or num_blocks > len(hash_ids):
        raise ValueError(f"prompt_len {prompt_len} needs {num_blocks} blocks of {tokens_per_block} tokens, "
                         f"the chain has {len(hash_ids)} hash ids")
    out: list[int] = []
    for h in hash_ids[:num_blocks]:
        out.extend(block_tokens(h, tokens_per_block, vocab_size, reserved_ids))
    return tuple(out[:prompt_len])
