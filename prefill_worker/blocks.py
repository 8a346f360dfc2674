"""Conversion between a request's cache (pages + KDA slot) and store blocks.

A request resumes from reused blocks (``resume_from_blocks``): device-tier pages it already
shares, then payloads copied into its own pages. A finished block leaves as a payload copy
(``payload_of_block``) only when the device tier cannot keep its page.

Block i covers tokens [i*bs, (i+1)*bs); its payload holds those rows of every MLA layer and,
when block i is a snapshot point, the KDA state after token (i+1)*bs::

    tokens  |-- block 0 --|-- block 1 --|-- block 2 --| ...
    snapshot              ^ (after 2*bs, if block 1 is a snapshot point)
"""

from __future__ import annotations

from collections.abc import Sequence

from engine import CacheManager, HybridModel, SequenceCache
from kvstore.device import Snapshot
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


def resume_from_blocks(model: HybridModel, cache: CacheManager, seq: SequenceCache, num_in_place: int,
                       in_place_snapshot: Snapshot | None, payloads: Sequence[BlockPayload]) -> int:
    """Resumes a fresh seq after its leading blocks: the first ``num_in_place`` are already its
    pages (shared device-tier pages, reused in place), ``payloads`` follow and are copied into
    its next pages. The KDA state comes from the last block's snapshot (``in_place_snapshot``
    when no payload follows), copied into seq's own slot; a payload's snapshot is also kept
    in ``seq.snapshots``, so the block can be stored again with it. Returns the number of
    tokens now cached. ValueError if the blocks do not fit the model or lack the snapshot."""
    if seq.num_tokens:
        raise ValueError(f"request {seq.request_id} already holds {seq.num_tokens} tokens")
    if not num_in_place and not payloads:
        return 0
    snapshot = (payloads[-1].kda_state, payloads[-1].kda_conv) if payloads else in_place_snapshot
    if snapshot is None or snapshot[0] is None or snapshot[1] is None:
        raise ValueError("the last reused block carries no KDA snapshot")
    cfg, bs = model.cfg, cache.block_size
    for p in payloads:
        if p.model_fingerprint != model.fingerprint or p.mla_layer_ids != cfg.mla_layer_ids:
            raise ValueError(f"block is for model {p.model_fingerprint}, layers {p.mla_layer_ids}; "
                             f"this worker serves {model.fingerprint}, layers {cfg.mla_layer_ids}")
        if p.block_size != bs:
            raise ValueError(f"block of {p.block_size} tokens, cache uses {bs}")
    kv = cache.pool.kv
    for i, p in enumerate(payloads, start=num_in_place):
        kv[:, seq.pages[i]] = p.mla.to(kv.device, kv.dtype)
        if p.has_snapshot:
            seq.snapshots[(i + 1) * bs] = (p.kda_state, p.kda_conv)
    cache.slots.state[:, seq.slot] = snapshot[0]
    cache.slots.conv[:, seq.slot] = snapshot[1]
    seq.num_tokens = (num_in_place + len(payloads)) * bs
    return seq.num_tokens
