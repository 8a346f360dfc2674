"""What one rank keeps of each weight: the column/row split of tensor parallelism and the
expert partition of expert parallelism.

Owns ``ShardPlan``: for one rank of a ``ParallelShape`` (``engine.parallel.shape``) it cuts
what ``engine.linear.linear_weight`` returns, never the checkpoint dict itself, so a packed
weight type plugs in the same way a plain tensor does: anything with ``shape`` and
``narrow(dim, start, length)`` (a packed format narrows its packed rows, or its groups along
the input dimension). The split, for a linear layer's ``[out, in]`` weight::

    column (split out)   y_local = x W_local^T             -> the local heads / columns
    row    (split in)    y_partial = x_local W_local^T     -> summed over the ranks (all-reduce)

A column split followed by a row split needs one all-reduce per block (Megatron): attention
projects q/k/v (column) and o_proj (row); the MLP gate/up (column) and down (row). The plan
itself only cuts; ``engine.parallel.comm`` sums. Frozen; pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.parallel.shape import SINGLE, ParallelShape


def split(weight: Any, dim: int, parts: int, index: int, name: str = "weight") -> Any:
    """Slice ``index`` of ``parts`` equal slices of ``weight`` along ``dim`` (a view for a
    tensor); ValueError naming ``name`` when the size does not divide."""
    if parts == 1:
        return weight
    size = weight.shape[dim]
    if size % parts:
        raise ValueError(f"{name}: dimension {dim} of shape {list(weight.shape)} is not divisible by {parts}")
    step = size // parts
    part = weight.narrow(dim, index * step, step)
    # A tensor's slice is copied so the full weight's memory is freed once the model is built.
    return part.clone(memory_format=torch.contiguous_format) if isinstance(part, torch.Tensor) else part


@dataclass(frozen=True)
class ShardPlan:
    """The slices rank ``rank`` of ``shape`` keeps. ``SINGLE_PLAN`` keeps everything."""

    shape: ParallelShape = SINGLE
    rank: int = 0

    def __post_init__(self) -> None:
        self.shape.coords(self.rank)  # ValueError outside the world

    @property
    def stage(self) -> int:
        return self.shape.coords(self.rank)[0]

    @property
    def e(self) -> int:
        return self.shape.coords(self.rank)[1]

    @property
    def t(self) -> int:
        return self.shape.coords(self.rank)[2]

    @property
    def tp(self) -> int:
        return self.shape.tp

    @property
    def ep(self) -> int:
        return self.shape.ep

    @property
    def stage_index(self) -> int:
        """This rank's index among the ``ep * tp`` ranks of its stage."""
        return self.e * self.tp + self.t

    @property
    def is_sharded(self) -> bool:
        return self.shape.ranks_per_stage > 1

    # ---- tensor parallel over t -----------------------------------------------------------
    def column(self, weight: Any, name: str = "weight") -> Any:
        """The output rows this rank computes (heads, MLP columns, vocabulary rows)."""
        return split(weight, 0, self.tp, self.t, name)

    def row(self, weight: Any, name: str = "weight") -> Any:
        """The input columns this rank multiplies (its heads' share of o_proj, down_proj)."""
        return split(weight, 1, self.tp, self.t, name)

    def local(self, n: int, name: str) -> int:
        """How many of ``n`` (heads, vocabulary rows) this rank holds."""
        if n % self.tp:
            raise ValueError(f"{name}={n} is not divisible by tp={self.tp}")
        return n // self.tp

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[lo, hi) of the vocabulary rows this rank holds."""
        n = self.local(vocab_size, "vocab_size")
        return self.t * n, (self.t + 1) * n

    # ---- shared experts: over every rank of the stage -------------------------------------
    def stage_column(self, weight: Any, name: str = "weight") -> Any:
        return split(weight, 0, self.shape.ranks_per_stage, self.stage_index, name)

    def stage_row(self, weight: Any, name: str = "weight") -> Any:
        return split(weight, 1, self.shape.ranks_per_stage, self.stage_index, name)

    # ---- expert parallel over e -----------------------------------------------------------
    def experts(self, num_experts: int) -> range:
        """The routed experts this rank holds (global ids)."""
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={self.ep}")
        n = num_experts // self.ep
        return range(self.e * n, (self.e + 1) * n)


SINGLE_PLAN = ShardPlan()
