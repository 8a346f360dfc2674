"""Kimi Delta Attention (KDA): the linear-attention layer with a fixed-size recurrent state.

Owns the KDA math of the reference page: projections, the causal short convolution with its
window, the per-channel forget gate, the delta rule (a recurrent single-token step and an
equivalent chunked form for prefill) and the gated output norm. All state math runs in fp32.

Per-request state of one layer (see ``engine.cache.StateSlots``)::

    recurrent  [H, D_k, D_v]   fp32, S in  o = S^T q
    conv       [K-1, 3*H*D]    the last K-1 pre-conv inputs of q | k | v (oldest first)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.linear import linear_weight
from engine.parallel.shard import SINGLE_PLAN, ShardPlan, split

DEFAULT_CHUNK_TOKENS = 64
# On CPU a chunk of 16 runs the delta rule about five times faster than 64 at 256 tokens: the
# pairwise decays cost C*D per token and are memory-bound there, while the extra sequential
# state steps (one per chunk) are cheap. Accelerators prefer fewer, larger chunks.
CPU_CHUNK_TOKENS = 16
# Decay exponents are clamped to at least this before exp: on CPU, exp of an input that
# underflows (below about -87, or -inf) takes a slow path, about 90x slower per element than a
# normal one, and long or strong decays put most pairwise exponents there. e^-80 (1.8e-35) in
# place of a smaller number or 0 changes no fp32 sum of O(1) terms.
EXP_FLOOR = -80.0


def chunk_tokens_for(device: str | torch.device) -> int:
    """The delta-rule chunk size for ``device``."""
    return CPU_CHUNK_TOKENS if torch.device(device).type == "cpu" else DEFAULT_CHUNK_TOKENS


@dataclass(frozen=True)
class KDAWeights:
    # Every projection of the layer input, stacked so one matmul computes them all:
    # [ q_proj | k_proj | v_proj (3*H*D) | f_a_proj (D) | b_proj (H) | g_a_proj (D) ] x hidden
    w_in: torch.Tensor
    conv: torch.Tensor  # [3*H*D, K]: q_conv1d | k_conv1d | v_conv1d stacked, depthwise
    w_o: torch.Tensor  # [hidden, H*D]
    a_neg: torch.Tensor  # [H, 1] = -exp(A_log), fp32
    dt_bias: torch.Tensor  # [H*D] fp32
    w_fb: torch.Tensor  # [H*D, D]
    w_gb: torch.Tensor  # [H*D, D]
    o_norm: torch.Tensor  # [D]

    @property
    def in_sizes(self) -> tuple[int, int, int, int]:
        """Widths of the w_in sections: q|k|v, f_a, b, g_a."""
        hd, d = self.w_fb.shape
        return 3 * hd, d, hd // d, d

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str, plan: ShardPlan = SINGLE_PLAN) -> KDAWeights:
        """The layer's weights; with a tensor-parallel ``plan``, this rank's heads: every
        per-head projection (q, k, v, b, f_b, g_b), conv channel, decay and bias split by head,
        o_proj by input columns; the low-rank f_a / g_a and the per-dim norm replicated."""
        g = lambda n: t[prefix + n]  # noqa: E731
        heads = lambda n: plan.column(linear_weight(t, prefix + n), prefix + n)  # noqa: E731
        w_in = [heads("q_proj"), heads("k_proj"), heads("v_proj"), linear_weight(t, prefix + "f_a_proj"),
                heads("b_proj"), linear_weight(t, prefix + "g_a_proj")]
        conv = [plan.column(g(n + ".weight"), prefix + n) for n in ("q_conv1d", "k_conv1d", "v_conv1d")]
        return cls(
            w_in=torch.cat(w_in, 0),
            conv=torch.cat(conv, 0).squeeze(1),
            w_o=plan.row(linear_weight(t, prefix + "o_proj"), prefix + "o_proj"),
            a_neg=-split(g("A_log").float().reshape(-1), 0, plan.tp, plan.t, prefix + "A_log").reshape(-1, 1).exp(),
            dt_bias=plan.column(g("dt_bias").float(), prefix + "dt_bias"),
            w_fb=heads("f_b_proj"),
            w_gb=heads("g_b_proj"),
            o_norm=g("o_norm.weight").float(),
        )


class KDALayer:
    """One KDA layer. Stateless itself: every call takes and returns the request state.
    ``num_heads``: the heads it computes (a tensor-parallel rank's share; default all), whose
    state and conv window the caller holds; the output is then a partial sum of o_proj."""

    def __init__(self, cfg: ModelConfig, w: KDAWeights, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 num_heads: int = 0):
        self.w = w
        self.num_heads, self.head_dim = num_heads or cfg.kda_num_heads, cfg.kda_head_dim
        self.eps = cfg.rms_norm_eps
        self.chunk_tokens = chunk_tokens

    # ---- shared pieces -----------------------------------------------------------------------
    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-conv q|k|v [N, 3*H*D], log forget gate g [N, H, D] (<= 0, fp32), write strength
        beta [N, H] (fp32) and the output gate's low-rank input [N, D], from one matmul."""
        w = self.w
        mixed, fa, b, ga = F.linear(x, w.w_in).split(w.in_sizes, -1)
        f = F.linear(fa, w.w_fb).float() + w.dt_bias
        g = w.a_neg * F.softplus(f.view(-1, self.num_heads, self.head_dim), threshold=20.0)
        return mixed, g, torch.sigmoid(b.float()), ga

    def _qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Splits post-conv activations [N, 3*H*D] into normalised, scaled q, k and v [N, H, D]."""
        n = mixed.shape[0]
        q, k, v = mixed.float().view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * self.head_dim**-0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        return q, k, v

    def _output(self, x: torch.Tensor, ga: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Gated per-head RMSNorm of o [N, H, D], then o_proj."""
        w = self.w
        gate = F.linear(ga, w.w_gb).float().view_as(o)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * w.o_norm
        o = (o * torch.sigmoid(gate)).to(x.dtype).reshape(o.shape[0], -1)
        return F.linear(o, w.w_o)

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(
        self, x: torch.Tensor, conv_window: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Runs T tokens x [T, hidden] from (conv_window, state); returns (out, new window, new state).

        Inputs are not modified; the caller stores the returned state.
        """
        w = self.w
        mixed, g, beta, ga = self._project(x)  # mixed [T, C]
        k_len = w.conv.shape[1]
        full = torch.cat([conv_window.to(mixed.dtype), mixed], 0)  # [K-1+T, C]
        new_window = full[-(k_len - 1):].float().clone()
        conv = F.conv1d(full.t().unsqueeze(0), w.conv.unsqueeze(1), groups=full.shape[1])[0].t()
        q, k, v = self._qkv(F.silu(conv))
        o, new_state = chunked_delta_rule(q, k, v, g, beta, state.float(), self.chunk_tokens)
        return self._output(x, ga, o), new_window, new_state

    # ---- decode -------------------------------------------------------------------------------
    def decode(self, x: torch.Tensor, conv_window: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One token for each of B requests: x [B, hidden], conv_window [B, K-1, C], state [B, H, D, D].

        Updates conv_window and state in place (they are per-batch gathered copies).
        """
        w = self.w
        mixed, g, beta, ga = self._project(x)  # mixed [B, C]
        full = torch.cat([conv_window.to(mixed.dtype), mixed.unsqueeze(1)], 1)  # [B, K, C]
        conv_window.copy_(full[:, 1:])
        q, k, v = self._qkv(F.silu((full * w.conv.t()).sum(1)))
        state.mul_(g.exp().unsqueeze(-1))
        u = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta.unsqueeze(-1)
        state.add_(k.unsqueeze(-1) * u.unsqueeze(-2))
        o = torch.einsum("bhkv,bhk->bhv", state, q)
        return self._output(x, ga, o)


def chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over T tokens in chunks; equals T recurrent steps.

    q, k, v, g: [T, H, D] fp32 (g is the log decay, <= 0); beta [T, H]; state [H, Dk, Dv].
    Returns (o [T, H, Dv], final state).

    Within a chunk, with G the cumulative log decay and S0 the state entering it:
        U = (I + diag(b) A)^-1 diag(b) (V - (K * e^G) S0),  A[t,s] = sum_c k_t k_s e^(G_t-G_s), s < t
        O = (Q * e^G) S0 + M U,                             M[t,s] = sum_c q_t k_s e^(G_t-G_s), s <= t
        S1 = e^(G_C) * S0 + (K * e^(G_C - G))^T U
    The pairwise decays are formed as exp(G_t - G_s) with s <= t, never as a product of
    exp(G_t) * exp(-G_s), which overflows. The two solves that do not depend on S0 run for all
    chunks at once; only the short state recurrence is sequential.
    """
    t_len, h, d_k = k.shape
    pad = (-t_len) % chunk_tokens
    if pad:
        q, k, v, g = (F.pad(a, (0, 0, 0, 0, 0, pad)) for a in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n, c = (t_len + pad) // chunk_tokens, chunk_tokens
    # [H, N, C, D] layout from here on.
    q, k, v, g = (a.view(n, c, h, -1).permute(2, 0, 1, 3) for a in (q, k, v, g))
    beta = beta.view(n, c, h).permute(2, 0, 1)
    G = g.cumsum(2)
    # decayed[h, n, t, s, d] = exp(G_t - G_s) k_s; then A and M come out of one batched matmul
    # against [k_t | q_t] (no einsum permute copies), and only their s <= t part is kept. Each
    # exponent is clamped to [EXP_FLOOR, 0] first: for s <= t it is <= 0 already (see
    # EXP_FLOOR); for s > t it is >= 0, and the clamp keeps those discarded entries finite.
    decayed = (G.unsqueeze(3) - G.unsqueeze(2)).clamp_(EXP_FLOOR, 0.0).exp_().mul_(k.unsqueeze(2))
    both = torch.matmul(torch.stack([k, q], 3), decayed.transpose(-1, -2))  # [H, N, C, 2, C]
    del decayed
    a_mat = both[..., 0, :].tril(-1) * beta.unsqueeze(-1)
    m_mat = both[..., 1, :].tril()
    eye = torch.eye(c, device=q.device, dtype=q.dtype)
    lower = eye + a_mat
    b_v = v * beta.unsqueeze(-1)
    decay = G.clamp_min(EXP_FLOOR).exp()  # e^G, [H, N, C, D]
    b_k = k * decay * beta.unsqueeze(-1)
    rhs = torch.cat([b_v, b_k], -1)
    sol = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    w_v, w_k = sol[..., : v.shape[-1]], sol[..., v.shape[-1]:]  # U = w_v - w_k @ S0
    q_dec = q * decay
    k_tail = k * (G[:, :, -1:] - G).clamp_min_(EXP_FLOOR).exp_()  # e^(G_C - G_s)
    g_last = decay[:, :, -1]  # [H, N, D]
    out = torch.empty_like(v)
    s = state
    for i in range(n):
        u = w_v[:, i] - w_k[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + m_mat[:, i] @ u
        s = g_last[:, i].unsqueeze(-1) * s + k_tail[:, i].transpose(-1, -2) @ u
    out = out.permute(1, 2, 0, 3).reshape(n * c, h, -1)[:t_len]
    return out, s
