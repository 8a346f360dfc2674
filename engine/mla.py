"""Multi-head Latent Attention (MLA, NoPE): the attention layer with a per-token latent cache.

Owns the MLA math: the query projection, the compressed latent (``kv_a_proj_with_mqa`` then
``kv_a_layernorm`` on its first ``kv_lora_rank`` values), prefill attention over expanded keys
and values, and a decode path that attends in the latent space: ``kv_b_proj`` is absorbed into
the query and the output, so a step reads the cache once and never re-expands it.

Cached row per token (``latent_dim = kv_lora_rank + qk_rope_head_dim``)::

    [ normalised latent c (kv_lora_rank) | shared rope key k_r (qk_rope_head_dim) ]

No rotary embedding is applied (``mla_use_nope``); k_r is shared by all heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig


@dataclass(frozen=True)
class MLAWeights:
    w_q: torch.Tensor  # [heads*(nope+rope), hidden]
    w_kv_a: torch.Tensor  # [latent_dim, hidden]
    kv_norm: torch.Tensor  # [kv_lora_rank]
    w_kv_b: torch.Tensor  # [heads*(nope+v), kv_lora_rank]
    w_o: torch.Tensor  # [hidden, heads*v]

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str) -> MLAWeights:
        return cls(
            w_q=t[prefix + "q_proj.weight"],
            w_kv_a=t[prefix + "kv_a_proj_with_mqa.weight"],
            kv_norm=t[prefix + "kv_a_layernorm.weight"],
            w_kv_b=t[prefix + "kv_b_proj.weight"],
            w_o=t[prefix + "o_proj.weight"],
        )


class MLALayer:
    """One MLA layer; the cache lives in the caller's pages and is passed in as latent rows."""

    def __init__(self, cfg: ModelConfig, w: MLAWeights):
        self.w = w
        self.heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.qk_head_dim**-0.5
        kv_b = w.w_kv_b.view(self.heads, self.nope + self.v_dim, self.rank)
        self.w_uk = kv_b[:, : self.nope].contiguous()  # [H, nope, r]: absorbed into the query
        self.w_uv = kv_b[:, self.nope:].contiguous()  # [H, v, r]: absorbed into the output

    def latents(self, x: torch.Tensor) -> torch.Tensor:
        """Cache rows [N, latent_dim] for hidden states x [N, hidden]."""
        ckv = F.linear(x, self.w.w_kv_a)
        c, k_r = ckv.split([self.rank, self.rope], -1)
        cf = c.float()
        c = (cf * torch.rsqrt(cf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.w.kv_norm
        return torch.cat([c, k_r], -1)

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = F.linear(x, self.w.w_q).view(x.shape[0], self.heads, self.nope + self.rope)
        return q[..., : self.nope], q[..., self.nope:]

    def prefill(self, x: torch.Tensor, past: torch.Tensor, new_rows: torch.Tensor) -> torch.Tensor:
        """Attention of T new tokens x [T, hidden] over past rows [P, L] and their own rows [T, L]."""
        t_len, p_len = x.shape[0], past.shape[0]
        q_nope, q_r = self._queries(x)
        rows = torch.cat([past, new_rows], 0)  # [P+T, L]
        c, k_r = rows.split([self.rank, self.rope], -1)
        kv = F.linear(c, self.w.w_kv_b).view(-1, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        k = torch.cat([k_nope, k_r.unsqueeze(1).expand(-1, self.heads, -1)], -1)
        q = torch.cat([q_nope, q_r], -1)
        # Token i of the chunk (absolute position P+i) sees keys [0, P+i].
        mask = torch.ones(t_len, p_len + t_len, dtype=torch.bool, device=x.device).tril(p_len)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=self.scale
        )
        return F.linear(o.transpose(0, 1).reshape(t_len, -1), self.w.w_o)

    def decode(self, x: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """One query per request: x [B, hidden] over its rows [B, Lmax, L] (valid [B, Lmax] bool).

        Attends in the latent space: q_lat = q_nope W_uk, score = [q_lat | q_r] . row, and the
        context (a mix of latents) goes through W_uv only once per head.
        """
        b = x.shape[0]
        q_nope, q_r = self._queries(x)
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, self.w_uk)
        q_cat = torch.cat([q_lat, q_r], -1)  # [B, H, L]
        scores = torch.bmm(q_cat, rows.transpose(1, 2)).float() * self.scale  # [B, H, Lmax]
        scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
        attn = torch.softmax(scores, -1).to(rows.dtype)
        ctx = torch.bmm(attn, rows[..., : self.rank])  # [B, H, r]
        o = torch.einsum("bhr,hvr->bhv", ctx, self.w_uv)
        return F.linear(o.reshape(b, -1), self.w.w_o)
