"""Multi-head Latent Attention (MLA): the attention layer with a per-token latent cache.

Owns the MLA math: the query projection (``q_proj``, or the low-rank ``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj`` when ``q_lora_rank`` is set), the compressed latent
(``kv_a_proj_with_mqa`` then ``kv_a_layernorm`` on its first ``kv_lora_rank`` values), prefill
attention over expanded keys and values (each token expanded once per prefill call:
``ExpandedPrefix``), and a decode path that attends in the latent space: ``kv_b_proj`` is
absorbed into the query and the output, so a step reads each cached row once and never
re-expands it.

Cached row per token (``latent_dim = kv_lora_rank + qk_rope_head_dim``)::

    [ normalised latent c (kv_lora_rank) | shared rope key k_r (qk_rope_head_dim) ]

k_r is shared by all heads. Kimi Linear applies no rotary embedding (``mla_use_nope``);
DeepSeek-V3/K2 rotate the rope dims of q and k by position (decoupled RoPE, ``engine.rope``),
and the row holds k_r already rotated at its token's position, so neither path re-rotates a
cached row. Both latent norms use eps 1e-6, as both references do (whatever ``rms_norm_eps``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.linear import linear_weight
from engine.parallel.shard import SINGLE_PLAN, ShardPlan
from engine.rope import Rotary

LATENT_NORM_EPS = 1e-6
Angles = tuple[torch.Tensor, torch.Tensor]
"""(cos, sin) [N, rope/2] of the N tokens' positions (``Rotary.angles``), or None without RoPE."""


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + LATENT_NORM_EPS)).to(x.dtype) * weight


@dataclass(frozen=True)
class MLAWeights:
    w_q: torch.Tensor | None  # [heads*(nope+rope), hidden]; None with a low-rank query
    w_kv_a: torch.Tensor  # [latent_dim, hidden]
    kv_norm: torch.Tensor  # [kv_lora_rank]
    w_kv_b: torch.Tensor  # [heads*(nope+v), kv_lora_rank]
    w_o: torch.Tensor  # [hidden, heads*v]
    w_q_a: torch.Tensor | None = None  # [q_lora_rank, hidden]
    q_norm: torch.Tensor | None = None  # [q_lora_rank]
    w_q_b: torch.Tensor | None = None  # [heads*(nope+rope), q_lora_rank]

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str, q_lora: bool = False,
                     plan: ShardPlan = SINGLE_PLAN) -> MLAWeights:
        """The layer's weights; with a tensor-parallel ``plan``, this rank's heads: the query
        and ``kv_b_proj`` split by output rows (head-major), ``o_proj`` by input columns. The
        latent projection and its norm (and the low-rank query's first half) are replicated,
        so every rank computes the same cache rows."""
        low_rank = {}
        if q_lora:
            low_rank = dict(w_q_a=linear_weight(t, prefix + "q_a_proj"), q_norm=t[prefix + "q_a_layernorm.weight"],
                            w_q_b=plan.column(linear_weight(t, prefix + "q_b_proj"), prefix + "q_b_proj"))
        return cls(
            w_q=None if q_lora else plan.column(linear_weight(t, prefix + "q_proj"), prefix + "q_proj"),
            w_kv_a=linear_weight(t, prefix + "kv_a_proj_with_mqa"),
            kv_norm=t[prefix + "kv_a_layernorm.weight"],
            w_kv_b=plan.column(linear_weight(t, prefix + "kv_b_proj"), prefix + "kv_b_proj"),
            w_o=plan.row(linear_weight(t, prefix + "o_proj"), prefix + "o_proj"),
            **low_rank,
        )


class MLALayer:
    """One MLA layer; the cache lives in the caller's pages and is passed in as latent rows.

    ``angles`` arguments are the positions' rotary angles (``Rotary.angles``), None without RoPE.
    ``num_heads``: the heads this layer computes (a tensor-parallel rank's share; default all).
    The output is then this rank's partial sum of o_proj, which the caller reduces.
    """

    def __init__(self, cfg: ModelConfig, w: MLAWeights, rotary: Rotary | None = None, num_heads: int = 0):
        self.w = w
        self.rotary = rotary
        self.heads = num_heads or cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim**-0.5 * (cfg.rope.softmax_scale_factor if cfg.rope is not None else 1.0)
        kv_b = w.w_kv_b.view(self.heads, self.nope + self.v_dim, self.rank)
        self.w_uk = kv_b[:, : self.nope].contiguous()  # [H, nope, r]: absorbed into the query
        self.w_uv = kv_b[:, self.nope:].contiguous()  # [H, v, r]: absorbed into the output

    def latents(self, x: torch.Tensor, angles: Angles | None) -> torch.Tensor:
        """Cache rows [N, latent_dim] for hidden states x [N, hidden] at the angles' positions."""
        ckv = F.linear(x, self.w.w_kv_a)
        c, k_r = ckv.split([self.rank, self.rope], -1)
        if self.rotary is not None:
            k_r = self.rotary.rotate(k_r, angles)
        return torch.cat([_rms(c, self.w.kv_norm), k_r], -1)

    def _queries(self, x: torch.Tensor, angles: Angles | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope [N, H, nope] and the (rotated) q_r [N, H, rope]."""
        if self.w.w_q is not None:
            q = F.linear(x, self.w.w_q)
        else:
            q = F.linear(_rms(F.linear(x, self.w.w_q_a), self.w.q_norm), self.w.w_q_b)
        q = q.view(x.shape[0], self.heads, self.nope + self.rope)
        q_nope, q_r = q[..., : self.nope], q[..., self.nope:]
        if self.rotary is not None:
            q_r = self.rotary.rotate(q_r, angles)
        return q_nope, q_r

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [H, N, nope+rope] and values [H, N, v] of cache rows [N, L] (kv_b_proj applied)."""
        c, k_r = rows.split([self.rank, self.rope], -1)
        kv = F.linear(c, self.w.w_kv_b).view(-1, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        k = torch.cat([k_nope, k_r.unsqueeze(1).expand(-1, self.heads, -1)], -1)
        return k.transpose(0, 1), v.transpose(0, 1)

    def prefill(self, x: torch.Tensor, prefix: ExpandedPrefix, new_rows: torch.Tensor,
                angles: Angles | None = None) -> torch.Tensor:
        """Attention of T new tokens x [T, hidden] over the expanded prefix and their own rows
        [T, L]; appends the new rows' keys and values to ``prefix``."""
        t_len = x.shape[0]
        p_len = prefix.num_tokens
        q_nope, q_r = self._queries(x, angles)
        k, v = prefix.append(*self.expand(new_rows))  # [H, P+T, D]
        q = torch.cat([q_nope, q_r], -1).transpose(0, 1)  # [H, T, D]
        # Token i of the chunk (absolute position P+i) sees keys [0, P+i]: only the chunk's own
        # block of the scores needs a mask. Written out rather than SDPA with a mask, which on
        # CPU materialises the mask per head and runs slower:
        #   scores [H, T, P+T] = | past: all visible | own [T, T]: causal |
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(self.scale).float()
        future = torch.ones(t_len, t_len, dtype=torch.bool, device=x.device).triu_(1)
        scores[..., p_len:].masked_fill_(future, float("-inf"))
        o = torch.bmm(torch.softmax(scores, -1).to(v.dtype), v)  # [H, T, v]
        return F.linear(o.transpose(0, 1).reshape(t_len, -1), self.w.w_o)

    def decode(self, x: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
               angles: Angles | None = None) -> torch.Tensor:
        """One query per request: x [B, hidden] over its rows [B, Lmax, L] (valid [B, Lmax] bool).

        Attends in the latent space: q_lat = q_nope W_uk, score = [q_lat | q_r] . row (the row's
        rope key is already rotated, q_r is rotated at the request's position), and the context
        (a mix of latents) goes through W_uv only once per head.
        """
        b = x.shape[0]
        q_nope, q_r = self._queries(x, angles)
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, self.w_uk)
        q_cat = torch.cat([q_lat, q_r], -1)  # [B, H, L]
        scores = torch.bmm(q_cat, rows.transpose(1, 2)).float() * self.scale  # [B, H, Lmax]
        scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
        attn = torch.softmax(scores, -1).to(rows.dtype)
        ctx = torch.bmm(attn, rows[..., : self.rank])  # [B, H, r]
        o = torch.einsum("bhr,hvr->bhv", ctx, self.w_uv)
        return F.linear(o.reshape(b, -1), self.w.w_o)


class ExpandedPrefix:
    """One MLA layer's expanded keys and values for the tokens of a prefill so far, so each
    chunk expands only its own rows (re-expanding the whole prefix per chunk is quadratic).

    Buffers hold ``capacity`` tokens, head-major so the attention reads contiguous slices::

        keys   [H, capacity, nope+rope]    values [H, capacity, v]     filled: [:, :num_tokens]

    Lives for one ``HybridModel.prefill`` call; not thread-safe.
    """

    def __init__(self, layer: MLALayer, capacity: int, dtype: torch.dtype, device: torch.device | str):
        self.keys = torch.empty(layer.heads, capacity, layer.nope + layer.rope, dtype=dtype, device=device)
        self.values = torch.empty(layer.heads, capacity, layer.v_dim, dtype=dtype, device=device)
        self.num_tokens = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add keys [H, N, Dk] and values [H, N, Dv]; returns views of everything so far."""
        end = self.num_tokens + keys.shape[1]
        if end > self.keys.shape[1]:
            raise ValueError(f"{end} tokens exceed the prefix capacity {self.keys.shape[1]}")
        self.keys[:, self.num_tokens : end] = keys
        self.values[:, self.num_tokens : end] = values
        self.num_tokens = end
        return self.keys[:, :end], self.values[:, :end]
