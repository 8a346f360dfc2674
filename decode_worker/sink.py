"""Where received KV lands: a transfer sink over one request's pages and KDA slot.

The engine keeps a CPU cache in shareable memory, so the sink also offers its pages as a direct
placement: a prefill worker on the same host (shm) copies each chunk straight into them, once,
and the receiver verifies it there before counting it (``kvstore.transfer.placement``).
"""

from __future__ import annotations

import torch

from engine import CacheManager, SequenceCache
from kvstore.transfer.base import Expected
from kvstore.transfer.sinks import PagePoolSink


def sink_for(cache: CacheManager, seq: SequenceCache) -> PagePoolSink:
    """Writes verified chunks straight into seq's reserved pages and its KDA slot (views into
    the slot tensors), or lets an shm sender write them there (verified in place). Runs on the
    receiver's I/O thread; touches only this request's memory."""
    cfg = cache.cfg
    return PagePoolSink(
        cache.pool.kv,
        torch.tensor(seq.pages),
        {layer: i for i, layer in enumerate(cfg.mla_layer_ids)},
        kda_state={layer: cache.slots.state[i, seq.slot] for i, layer in enumerate(cfg.kda_layer_ids)},
        kda_conv={layer: cache.slots.conv[i, seq.slot] for i, layer in enumerate(cfg.kda_layer_ids)},
    )


def expected_for(cache: CacheManager, num_prompt_tokens: int) -> Expected:
    """Every MLA layer's rows for the whole prompt, and every KDA layer's final state (none for a
    model whose cache layout has no state layers)."""
    layout = cache.cfg.cache_layout
    return Expected(
        mla_layers=layout.mla_layer_ids, token_start=0, token_end=num_prompt_tokens,
        mla_row_shape=(layout.latent_dim,), mla_dtype=cache.pool.kv.dtype,
        kda_layers=layout.state_layer_ids, kda_state_shape=layout.state_shape,
        kda_conv_shape=layout.conv_shape, kda_dtype="float32",
    )
