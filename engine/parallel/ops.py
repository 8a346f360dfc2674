"""The schedule rank 0 hands to the other ranks: one op at a time, as int64 vectors.

Owns the op codes and their layouts, and the parts of each op that every rank does the same
way (``sync_prefix``: the rows and state a rank needs before computing on a request whose
cache rank 0 filled from elsewhere; ``gather_state``: a request's KDA state assembled at rank 0
in the canonical layout). ``engine.parallel.leader`` sends, ``engine.parallel.follower``
receives; both call the shared parts with the same arguments, which keeps them in lockstep::

    header  [op, a0 .. a8]                    HEADER_LEN int64, broadcast from rank 0
    NEW_CACHE   a = cache_id, num_pages, num_slots, block_size
    DROP_CACHE  a = cache_id
    PREFILL     a = cache_id, slot, start, n_ids, n_pages, n_points, chunk_tokens, flags, n_copies
                ints: pages | ids | snapshot points | copies (src, dst)*
                [flags & SYNC: sync_prefix(start)]  then per chunk: a continue flag and
                gather_state at each point in it; at the end gather_state
    DECODE      a = cache_id, batch, n_ints, n_copies
                ints: per request (slot, num_tokens, token, sync, n_pages, pages...) | copies
                then sync_prefix(num_tokens) of each request with sync set
    CPP_PREFILL a = as PREFILL, then pipe_tokens; the stages exchange the rest point to point
                (engine.parallel.pipeline)
    NOOP, SHUTDOWN

Copies are the copy-on-write page copies rank 0 made before the op (a shared page written
by the op), which every other rank repeats in its own pool first.
"""

from __future__ import annotations

import enum

import torch

from engine.cache import CacheManager, SequenceCache
from engine.parallel.group import Channel
from engine.parallel.state import conv_part, merge_convs, merge_states, state_part

HEADER_LEN = 12
ALL_LOGITS, SYNC = 1, 2  # PREFILL flags


class Op(enum.IntEnum):
    SHUTDOWN = 1
    NEW_CACHE = 2
    DROP_CACHE = 3
    PREFILL = 4
    DECODE = 5
    CPP_PREFILL = 6  # a pipelined prefill through the stages (engine.parallel.pipeline)
    NOOP = 7  # keeps idle ranks from timing out (engine.parallel.face)


class PrefillAborted(Exception):
    """Rank 0 called a prefill off at a chunk boundary (its layer hook raised: the client left,
    a transfer failed); every rank stops there together."""


def header(op: Op, *args: int) -> list[int]:
    assert len(args) < HEADER_LEN, args
    return [int(op), *args] + [0] * (HEADER_LEN - 1 - len(args))


def apply_copies(cache: CacheManager, copies: list[int]) -> None:
    """Repeats rank 0's copy-on-write copies (flattened ``src, dst`` pairs) in this pool."""
    kv = cache.pool.kv
    for i in range(0, len(copies), 2):
        kv[:, copies[i + 1]] = kv[:, copies[i]]


def sync_prefix(channel: Channel, tp: int, t_of: list[int], shard: CacheManager, seq: SequenceCache,
                num_tokens: int, canonical: CacheManager | None) -> None:
    """Collective: the rows of tokens [0, num_tokens) of every MLA layer, from rank 0's
    canonical cache into every rank's pages (one broadcast: the latent is the same on every
    rank), and the request's KDA state and conv window cut by head (a scatter: ``t_of[r]`` is
    rank r's tensor-parallel index). ``canonical`` is rank 0's cache (None elsewhere)."""
    num_mla, latent = shard.pool.kv.shape[0], shard.pool.kv.shape[-1]
    if num_tokens > 0:
        if canonical is not None:
            rows = torch.stack([canonical.rows(seq, i, 0, num_tokens) for i in range(num_mla)]).contiguous()
        else:
            rows = shard.pool.kv.new_empty((num_mla, num_tokens, latent))
        channel.tensor(rows)
        if canonical is None:  # rank 0's pool is the canonical one: its rows are there already
            for i in range(num_mla):
                shard.write_rows(seq, i, 0, rows[i])
    if not shard.cfg.kda_layer_ids:
        return
    slot, head_dim = seq.slot, shard.cfg.kda_head_dim
    states = convs = None
    if canonical is not None:
        full_state, full_conv = canonical.slots.state[:, slot], canonical.slots.conv[:, slot]
        states = [state_part(full_state, tp, t) for t in t_of]
        convs = [conv_part(full_conv, tp, t, head_dim) for t in t_of]
    out = shard.slots.state[:, slot].clone()
    shard.slots.state[:, slot] = channel.scatter(out, states)
    out = shard.slots.conv[:, slot].clone()
    shard.slots.conv[:, slot] = channel.scatter(out, convs)


def gather_state(channel: Channel, tp: int, shard: CacheManager, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Collective: the request's KDA (state, conv) in the canonical layout at rank 0 (ranks
    0..tp-1 hold one head slice each; others repeat them), None elsewhere and for a model
    without KDA layers."""
    if not shard.cfg.kda_layer_ids:
        return None
    states = channel.gather(shard.slots.state[:, slot])
    convs = channel.gather(shard.slots.conv[:, slot])
    if states is None or convs is None:
        return None
    return merge_states(states[:tp]), merge_convs(convs[:tp], shard.cfg.kda_head_dim)
