"""Feed-forward blocks: the dense SwiGLU MLP and the routed mixture of experts.

Owns the sigmoid router (correction bias for choice only, renormalised top-k weights,
routed scaling factor, optional group limit) and the expert dispatch. Dispatch never loops
over tokens: small batches gather the chosen experts' weights and run batched matmuls; large
ones sort tokens by expert and run one matmul per expert that received tokens (always on CPU,
where gathering weights costs more memory traffic than it saves, and for quantized experts,
each an ``engine.quant`` linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.parallel.shard import SINGLE_PLAN, ShardPlan
from engine.quant.ops import Weight, fused, linear, stacked


@dataclass(frozen=True)
class MLPWeights:
    w_gate_up: Weight  # [2*I, hidden]: gate_proj | up_proj (dense, or one quantized linear)
    w_down: Weight  # [hidden, I]

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str, plan: ShardPlan = SINGLE_PLAN,
                     over_stage: bool = False) -> MLPWeights:
        """The MLP's weights; with a ``plan``, this rank's intermediate columns (gate/up split by
        output rows, down by input columns) over the tp group, or over every rank of the stage
        (``over_stage``: the shared experts). The output is then a partial sum."""
        col, row = (plan.stage_column, plan.stage_row) if over_stage else (plan.column, plan.row)
        return cls(fused(t, [prefix + "gate_proj", prefix + "up_proj"], col), fused(t, [prefix + "down_proj"], row))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.w_gate_up).chunk(2, -1)
        return linear(F.silu(gate) * up, self.w_down)


@dataclass(frozen=True)
class MoEWeights:
    router: torch.Tensor  # [E, hidden] fp32
    bias: torch.Tensor  # [E] fp32, used for choosing only
    w13: torch.Tensor | tuple[Weight, ...]  # [E, 2*I, hidden]: w1 (gate) | w3 (up); per expert when quantized
    w2: torch.Tensor | tuple[Weight, ...]  # [E, hidden, I]
    shared: MLPWeights

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str, num_experts: int,
                     names: tuple[str, str, str] = ("w1", "w3", "w2"), plan: ShardPlan = SINGLE_PLAN) -> MoEWeights:
        """``names``: each expert's (gate, up, down) projection, as the checkpoint calls them.
        With a ``plan``: only this rank's experts (``plan.experts``, expert parallelism), each
        split over the tp group like a dense MLP, and the shared experts split over the stage;
        the router is replicated, so every rank routes every token the same way."""
        gate, up, down = names
        e = [f"{prefix}experts.{i}." for i in plan.experts(num_experts)]
        return cls(
            router=t[prefix + "gate.weight"].float(),
            bias=t[prefix + "gate.e_score_correction_bias"].float(),
            w13=stacked([fused(t, [p + gate, p + up], plan.column) for p in e]),
            w2=stacked([fused(t, [p + down], plan.row) for p in e]),
            shared=MLPWeights.from_tensors(t, prefix + "shared_experts.", plan, over_stage=True),
        )


class MoE:
    """The routed experts and the shared ones. ``expert_start``: the global id of ``w``'s first
    expert (expert parallelism holds ``len(w.w13)`` consecutive experts from there): pairs
    routed to other ranks' experts are skipped, and the output is this rank's partial sum."""

    def __init__(self, cfg: ModelConfig, w: MoEWeights, expert_start: int = 0):
        self.w = w
        self.top_k = cfg.num_experts_per_token
        self.num_experts = cfg.num_experts
        self.expert_start, self.num_local = expert_start, len(w.w13)
        self.groups, self.topk_group = cfg.num_expert_group, cfg.topk_group
        self.renormalize = cfg.moe_renormalize
        self.scaling = cfg.routed_scaling_factor
        # Gathering expert weights copies them; it only beats one matmul per expert on
        # accelerators, where launches cost more than bytes. On CPU always group; quantized
        # experts (a tuple of linears) and a rank's share of the experts always group too.
        dense_accelerator = isinstance(w.w13, torch.Tensor) and w.w13.device.type != "cpu"
        partitioned = self.num_local != self.num_experts
        self.gather_max_pairs = cfg.num_experts if dense_accelerator and not partitioned else 0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen experts [N, k] and their weights [N, k] (fp32) for x [N, hidden]."""
        scores = torch.sigmoid(F.linear(x.float(), self.w.router))
        choice = scores + self.w.bias
        if self.groups > 1:
            grouped = choice.view(-1, self.groups, self.num_experts // self.groups)
            group_scores = grouped.topk(2, -1).values.sum(-1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, -1).indices, 1.0)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(self.num_experts // self.groups, 1), -torch.inf)
        idx = choice.topk(self.top_k, -1).indices
        weights = scores.gather(1, idx)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * self.scaling

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        idx, weights = self.route(x)
        if idx.numel() <= self.gather_max_pairs:
            routed = self._gathered(x, idx, weights)
        else:
            routed = self._grouped(x, idx, weights)
        return routed + self.w.shared(x)

    def _gathered(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Few tokens: gather the chosen experts' weights and run one batched matmul."""
        n, k = idx.shape
        flat = idx.reshape(-1)
        xs = x.repeat_interleave(k, 0).unsqueeze(-1)  # [n*k, hidden, 1]
        gate, up = torch.bmm(self.w.w13[flat], xs).squeeze(-1).chunk(2, -1)
        y = torch.bmm(self.w.w2[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [n*k, hidden]
        return (y.view(n, k, -1) * weights.unsqueeze(-1).to(y.dtype)).sum(1)

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Many tokens: sort (token, slot) pairs by expert, one matmul per expert with tokens.
        Under expert parallelism only the pairs of this rank's experts (their local ids)."""
        n, k = idx.shape
        flat = idx.reshape(-1) - self.expert_start
        if self.num_local != self.num_experts:
            mine = ((flat >= 0) & (flat < self.num_local)).nonzero().squeeze(1)  # pair indices
            order = mine[flat[mine].argsort(stable=True)]
            flat = flat[mine]
        else:
            order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_local).tolist()
        token_of = order // k
        xs = x[token_of]
        out = torch.empty_like(xs)
        start = 0
        for e, cnt in enumerate(counts):
            if cnt:
                gate, up = linear(xs[start : start + cnt], self.w.w13[e]).chunk(2, -1)
                out[start : start + cnt] = linear(F.silu(gate) * up, self.w.w2[e])
                start += cnt
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, out)
