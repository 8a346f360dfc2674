"""Where received KV lands: a transfer sink that writes chunks into one request's pages/slot."""

from __future__ import annotations

from typing import Any

from engine import CacheManager, SequenceCache
from kvstore.transfer.base import Expected
from kvstore.transfer.frames import Kind


class PageSink:
    """Writes verified chunks of one request straight into its reserved pages and KDA slot.

    Runs on the transfer receiver's I/O thread; touches only this request's pages and slot.
    """

    def __init__(self, cache: CacheManager, seq: SequenceCache):
        self.cache, self.seq = cache, seq
        cfg = cache.cfg
        self._mla = {layer: i for i, layer in enumerate(cfg.mla_layer_ids)}
        self._kda = {layer: i for i, layer in enumerate(cfg.kda_layer_ids)}

    def write(self, kind: Kind, layer: int, token_start: int, token_end: int, tensor: Any) -> None:
        if kind == Kind.MLA_ROWS:
            if layer not in self._mla:
                raise ValueError(f"layer {layer} is not an MLA layer")
            self.cache.write_rows(self.seq, self._mla[layer], token_start, tensor)
        elif kind == Kind.KDA_STATE:
            self.cache.slots.state[self._kda[layer], self.seq.slot] = tensor
        elif kind == Kind.KDA_CONV:
            self.cache.slots.conv[self._kda[layer], self.seq.slot] = tensor
        else:
            raise ValueError(f"unexpected chunk kind {kind!r} for a decode destination")


def expected_for(cache: CacheManager, num_prompt_tokens: int) -> Expected:
    """Every MLA layer's rows for the whole prompt, and every KDA layer's final state."""
    cfg = cache.cfg
    return Expected(
        mla_layers=cfg.mla_layer_ids, token_start=0, token_end=num_prompt_tokens,
        mla_row_shape=(cfg.latent_dim,), mla_dtype=cache.pool.kv.dtype,
        kda_layers=cfg.kda_layer_ids,
        kda_state_shape=(cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim),
        kda_conv_shape=(cfg.conv_window_len, cfg.conv_channels), kda_dtype="float32",
    )
