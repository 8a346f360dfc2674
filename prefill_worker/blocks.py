"""Conversion between a request's cache (pages + KDA slot) and store blocks.

Block i covers tokens [i*bs, (i+1)*bs); its payload holds those rows of every MLA layer and,
when block i is a snapshot point, the KDA state after token (i+1)*bs::

    tokens  |-- block 0 --|-- block 1 --|-- block 2 --| ...
    snapshot              ^ (after 2*bs, if block 1 is a snapshot point)
"""

from __future__ import annotations

from collections.abc import Sequence

from engine import CacheManager, HybridModel, SequenceCache
from kvstore.payload import BlockPayload


def payload_of_block(model: HybridModel, cache: CacheManager, seq: SequenceCache, index: int) -> BlockPayload:
    """Block ``index`` of seq as a payload (with a snapshot if one was taken at its end)."""
    bs, cfg = cache.block_size, model.cfg
    hi = (index + 1) * bs
    mla = cache.pool.kv[:, seq.pages[index]].clone()  # [num_mla_layers, bs, latent_dim]
    assert hi <= seq.num_tokens, f"block {index} not fully computed ({seq.num_tokens} tokens)"
    snap = seq.snapshots.get(hi)
    return BlockPayload(
        model_fingerprint=model.fingerprint, mla=mla, mla_layer_ids=cfg.mla_layer_ids,
        kda_state=None if snap is None else snap[0], kda_conv=None if snap is None else snap[1],
        kda_layer_ids=cfg.kda_layer_ids if snap is not None else (),
    )


def load_blocks(model: HybridModel, cache: CacheManager, seq: SequenceCache, payloads: Sequence[BlockPayload]) -> int:
    """Writes leading blocks into a fresh seq and resumes its KDA state from the last block's
    snapshot. Returns the number of tokens now cached. ValueError if they do not fit the model."""
    if seq.num_tokens:
        raise ValueError(f"request {seq.request_id} already holds {seq.num_tokens} tokens")
    if not payloads:
        return 0
    last = payloads[-1]
    if not last.has_snapshot:
        raise ValueError("the last reused block carries no KDA snapshot")
    cfg = model.cfg
    for p in payloads:
        if p.model_fingerprint != model.fingerprint or p.mla_layer_ids != cfg.mla_layer_ids:
            raise ValueError(f"block is for model {p.model_fingerprint}, layers {p.mla_layer_ids}; "
                             f"this worker serves {model.fingerprint}, layers {cfg.mla_layer_ids}")
        if p.block_size != cache.block_size:
            raise ValueError(f"block of {p.block_size} tokens, cache uses {cache.block_size}")
    for i, p in enumerate(payloads):
        cache.pool.kv[:, seq.pages[i]] = p.mla.to(cache.pool.kv.device, cache.pool.kv.dtype)
    cache.slots.state[:, seq.slot] = last.kda_state
    cache.slots.conv[:, seq.slot] = last.kda_conv
    seq.num_tokens = len(payloads) * cache.block_size
    return seq.num_tokens
