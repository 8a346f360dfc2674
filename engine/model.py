"""The model: a stack of KDA and MLA layers with dense/MoE feed-forwards, run against a
``CacheManager``. One class serves every architecture: Kimi Linear (KDA + MLA, NoPE) and
DeepSeek-V3/K2 (MLA with decoupled RoPE only, so no KDA state); the layer map, the RoPE and the
tensor names come from the config.

Owns the two forward passes the servers use:
- ``prefill``: one request, its uncached tokens in chunks (cut at a configured size and at
  requested snapshot points); after each layer of each chunk an optional hook fires so a
  prefill worker can push that layer's rows while the next layer computes.
- ``decode_step``: one token for each of a batch of requests of different lengths.
Both read and write the request's pages and state slot in place; neither allocates cache
memory (the caller reserves or extends pages first).

One rank of a parallel instance (``engine.parallel``) builds the same class with its
``ShardPlan`` and ``Comm``: it keeps its heads, MLP columns, experts and vocabulary rows, its
cache holds its KDA heads' state (``cache_cfg``), and the forward passes sum the partial
outputs (one all-reduce after attention and one after the feed-forward of every layer, one
for the vocabulary-split embedding) and gather the logits' vocabulary slices. With the
default plan and ``LOCAL`` every collective is the identity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.arch import tensor_names
from engine.cache import CacheManager, SequenceCache
from engine.config import ModelConfig
from engine.kda import KDALayer, KDAWeights, chunk_tokens_for
from engine.linear import linear_weight
from engine.mla import Angles, ExpandedPrefix, MLALayer, MLAWeights
from engine.moe import MLPWeights, MoE, MoEWeights
from engine.parallel.comm import LOCAL, Comm
from engine.parallel.shard import SINGLE_PLAN, ShardPlan
from engine.rope import Rotary

LayerHook = Callable[[int, int, int], None]
"""``hook(layer_id, token_start, token_end)``: called once a layer's cache for that range is written."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass(frozen=True)
class Block:
    layer_id: int
    attn: KDALayer | MLALayer
    ffn: MLPWeights | MoE
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    cache_index: int  # index among MLA layers (pool) or among KDA layers (slots)

    @property
    def is_mla(self) -> bool:
        return isinstance(self.attn, MLALayer)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoE)


class HybridModel:
    """Weights plus the forward passes. Thread-compatible: callers serialise use of a cache.

    ``plan``/``comm``: this rank's share of a parallel instance (default: the whole model on
    one rank). The tensors are the full checkpoint's; ``fingerprint`` is the full model's, so
    every shape of an instance produces and reuses the same blocks. ``layers``: the layers this
    rank computes (a pipeline stage, ``engine.parallel.pipeline``; default all): only the first
    stage embeds and only the last one has the final norm and the LM head."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], fingerprint: str,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, prefill_chunk_tokens: int = 256,
                 plan: ShardPlan = SINGLE_PLAN, comm: Comm = LOCAL, layers: range | None = None):
        self.cfg, self.fingerprint, self.device, self.dtype = cfg, fingerprint, device, dtype
        self.layers = layers if layers is not None else range(cfg.num_hidden_layers)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.plan, self.comm = plan, comm
        plan.shape.check(cfg)
        # The cache of this rank: its KDA heads' state; MLA rows are whole on every rank.
        self.cache_cfg = dataclasses.replace(cfg, kda_num_heads=cfg.kda_num_heads // plan.tp) if plan.tp > 1 else cfg
        fp32_names = ("A_log", "dt_bias", "gate.weight", "e_score_correction_bias")
        t = {n: v.to(device=device, dtype=torch.float32 if n.endswith(fp32_names) else dtype)
             for n, v in tensors.items()}
        self.vocab_lo, self.vocab_hi = plan.vocab_range(cfg.vocab_size)
        first, last = self.layers.start == 0, self.layers.stop == cfg.num_hidden_layers
        embed = plan.column(t["model.embed_tokens.weight"], "model.embed_tokens.weight")
        self.embed = embed if first or (last and cfg.tie_word_embeddings) else None
        lm_head = embed if cfg.tie_word_embeddings else (plan.column(linear_weight(t, "lm_head"), "lm_head")
                                                          if last else None)
        self.lm_head = lm_head if last else None
        self.final_norm = t["model.norm.weight"]
        self.rotary = Rotary(cfg.rope, cfg.qk_rope_head_dim, device) if cfg.rope is not None else None
        self.blocks = [self._block(t, i) for i in self.layers]

    def _block(self, t: dict[str, torch.Tensor], i: int) -> Block:
        cfg, p, plan = self.cfg, f"model.layers.{i}.", self.plan
        if cfg.is_mla(i):
            w = MLAWeights.from_tensors(t, p + "self_attn.", q_lora=cfg.q_lora_rank is not None, plan=plan)
            attn: KDALayer | MLALayer = MLALayer(cfg, w, self.rotary, plan.local(cfg.num_attention_heads,
                                                                                 "num_attention_heads"))
            index = cfg.mla_layer_ids.index(i)
        else:
            attn = KDALayer(cfg, KDAWeights.from_tensors(t, p + "self_attn.", plan), chunk_tokens_for(self.device),
                            self.cache_cfg.kda_num_heads)
            index = cfg.kda_layer_ids.index(i)
        if cfg.is_moe(i):
            names = tensor_names(cfg)
            w_moe = MoEWeights.from_tensors(t, p + names.moe, cfg.num_experts,
                                            (names.expert_gate, names.expert_up, names.expert_down), plan)
            ffn: MLPWeights | MoE = MoE(cfg, w_moe, plan.experts(cfg.num_experts).start)
        else:
            ffn = MLPWeights.from_tensors(t, p + "mlp.", plan)
        return Block(i, attn, ffn, t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"], index)

    def new_cache(self, num_pages: int, num_slots: int, block_size: int) -> CacheManager:
        """A cache for this rank (its KDA heads; on one rank, the whole model's)."""
        return CacheManager(self.cache_cfg, num_pages, num_slots, block_size, self.dtype, self.device)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, hidden] of token ids [N]; the vocabulary split over the tp group
        looks up the ids in this rank's rows and sums (exactly one rank holds each row)."""
        if self.plan.tp == 1:
            return F.embedding(ids, self.embed)
        local = ids - self.vocab_lo
        other = (local < 0) | (local >= self.vocab_hi - self.vocab_lo)
        x = F.embedding(local.masked_fill(other, 0), self.embed).masked_fill_(other.unsqueeze(-1), 0.0)
        return self.comm.reduce_tp(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab]: this rank's vocabulary slice, gathered over the tp group."""
        local = F.linear(rms_norm(hidden, self.final_norm, self.cfg.rms_norm_eps), self.lm_head)
        return self.comm.gather_tp(local).float()

    def _layer(self, blk: Block, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The rest of a layer after its attention: the residual sums, the feed-forward, and
        the two reductions of partial sums (over the tp group after attention; after the
        feed-forward over the tp group for a dense MLP, over the stage for the MoE)."""
        x = x + self.comm.reduce_tp(attn_out)
        f = blk.ffn(rms_norm(x, blk.post_norm, self.cfg.rms_norm_eps))
        return x + (self.comm.reduce_stage(f) if blk.is_moe else self.comm.reduce_tp(f))

    def _angles(self, positions: torch.Tensor) -> Angles | None:
        """The rotary angles of ``positions`` [N], shared by every MLA layer; None without RoPE."""
        return None if self.rotary is None else self.rotary.angles(positions, self.dtype)

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(
        self, cache: CacheManager, seq: SequenceCache, token_ids: Sequence[int], *,
        all_logits: bool = False, chunk_tokens: int | None = None, snapshot_at: Sequence[int] = (),
        on_layer: LayerHook | None = None, on_chunk: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        """Appends token_ids at positions [seq.num_tokens, +len) and returns float32 logits:
        [len, vocab] if all_logits else [1, vocab] for the last token.

        Chunks are cut every ``chunk_tokens`` and at each absolute position in ``snapshot_at``,
        where a copy of the KDA state is kept in ``seq.snapshots`` (no recomputation). A model
        without KDA layers keeps its (empty) state at those positions without cutting there.
        ``on_chunk(lo, hi)`` runs after each chunk [lo, hi), its snapshots taken (a parallel
        instance's ranks meet there: ``engine.parallel.leader``).
        """
        start = seq.num_tokens
        end = start + len(token_ids)
        if end > len(seq.pages) * cache.block_size:
            raise ValueError(f"request {seq.request_id}: {end} tokens need more than its {len(seq.pages)} pages")
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device)
        outs = []
        prefixes = self.expanded_prefixes(cache, seq, end)
        cuts = snapshot_at if self.cfg.cache_layout.has_state else ()
        for lo, hi in chunk_ranges(start, end, chunk_tokens or self.prefill_chunk_tokens, cuts):
            hidden = self._prefill_chunk(cache, seq, ids[lo - start : hi - start], lo, on_layer, prefixes)
            seq.num_tokens = hi
            for point in (p for p in snapshot_at if lo < p <= hi):  # == hi when there is state to cut for
                seq.snapshots[point] = (cache.slots.state[:, seq.slot].clone(), cache.slots.conv[:, seq.slot].clone())
            if on_chunk is not None:
                on_chunk(lo, hi)
            outs.append(hidden if all_logits else hidden[-1:])
        return self.logits(torch.cat(outs) if all_logits else outs[-1])

    def expanded_prefixes(self, cache: CacheManager, seq: SequenceCache, end: int) -> dict[int, ExpandedPrefix]:
        """Per MLA layer, the expanded keys/values of the tokens already cached (a reused prefix
        or earlier calls), with room up to ``end``; the chunks of this call append to them."""
        prefixes = {}
        for blk in self.blocks:
            if blk.is_mla:
                prefix = ExpandedPrefix(blk.attn, end, self.dtype, self.device)
                if seq.num_tokens:
                    prefix.append(*blk.attn.expand(cache.rows(seq, blk.cache_index, 0, seq.num_tokens)))
                prefixes[blk.layer_id] = prefix
        return prefixes

    def _prefill_chunk(self, cache: CacheManager, seq: SequenceCache, ids: torch.Tensor, start: int,
                       on_layer: LayerHook | None, prefixes: dict[int, ExpandedPrefix]) -> torch.Tensor:
        return self.forward_layers(cache, seq, self.embed_tokens(ids), start, on_layer, prefixes)

    def forward_layers(self, cache: CacheManager, seq: SequenceCache, x: torch.Tensor, start: int,
                       on_layer: LayerHook | None, prefixes: dict[int, ExpandedPrefix]) -> torch.Tensor:
        """This model's layers over hidden states x [T, hidden] of tokens [start, start+T):
        writes their cache rows and state, fires ``on_layer`` after each; returns the hidden
        states after the last of them (a pipeline stage hands them to the next one)."""
        end = start + x.shape[0]
        eps = self.cfg.rms_norm_eps
        angles = self._angles(torch.arange(start, end, device=self.device))
        for blk in self.blocks:
            h = rms_norm(x, blk.in_norm, eps)
            if blk.is_mla:
                rows = blk.attn.latents(h, angles)
                out = blk.attn.prefill(h, prefixes[blk.layer_id], rows, angles)
                cache.write_rows(seq, blk.cache_index, start, rows)
            else:
                k, s = blk.cache_index, seq.slot
                out, window, state = blk.attn.prefill(h, cache.slots.conv[k, s], cache.slots.state[k, s])
                cache.slots.conv[k, s] = window
                cache.slots.state[k, s] = state
            x = self._layer(blk, x, out)
            if on_layer is not None:
                on_layer(blk.layer_id, start, end)
        return x

    # ---- decode -------------------------------------------------------------------------------
    def decode_step(self, cache: CacheManager, seqs: Sequence[SequenceCache], token_ids: Sequence[int]) -> torch.Tensor:
        """Feeds token_ids[b] at position seqs[b].num_tokens for every b; returns logits [B, vocab]."""
        dev, bs = self.device, cache.block_size
        pos = torch.tensor([s.num_tokens for s in seqs], device=dev)
        for s in seqs:
            if s.num_tokens >= len(s.pages) * bs:
                raise ValueError(f"request {s.request_id}: no page for position {s.num_tokens}; extend first")
            cache.ensure_writable(s, s.num_tokens // bs)
        max_pages = max(len(s.pages) for s in seqs)
        table = torch.tensor([s.pages + [0] * (max_pages - len(s.pages)) for s in seqs], device=dev)
        flat_table = table.reshape(-1)
        write_page = table.gather(1, (pos // bs).unsqueeze(1)).squeeze(1)
        write_off = pos % bs
        valid = torch.arange(max_pages * bs, device=dev).unsqueeze(0) <= pos.unsqueeze(1)
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        x = self.embed_tokens(torch.as_tensor(list(token_ids), device=dev))
        eps = self.cfg.rms_norm_eps
        angles = self._angles(pos)
        for blk in self.blocks:
            h = rms_norm(x, blk.in_norm, eps)
            if blk.is_mla:
                kv = cache.pool.kv[blk.cache_index]
                kv[write_page, write_off] = blk.attn.latents(h, angles)
                # index_select: on CPU about 3x faster than advanced indexing for this gather
                rows = kv.index_select(0, flat_table).reshape(len(seqs), max_pages * bs, -1)
                out = blk.attn.decode(h, rows, valid, angles)
            else:
                k = blk.cache_index
                state = cache.slots.state[k].index_select(0, slots)
                window = cache.slots.conv[k].index_select(0, slots)
                out = blk.attn.decode(h, window, state)
                cache.slots.state[k].index_copy_(0, slots, state)
                cache.slots.conv[k].index_copy_(0, slots, window)
            x = self._layer(blk, x, out)
        for s in seqs:
            s.num_tokens += 1
        return self.logits(x)


def chunk_ranges(start: int, end: int, size: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """[lo, hi) ranges covering [start, end): at most ``size`` long, also cut at every ``cuts``."""
    bounds = sorted({c for c in cuts if start < c < end} | set(range(start + size, end, size)) | {end})
    out, lo = [], start
    for hi in bounds:
        while hi - lo > size:
            out.append((lo, lo + size))
            lo += size
        out.append((lo, hi))
        lo = hi
    return out
