"""What the model code calls so that a weight may be dense or quantized: ``linear``, ``fused``,
``stacked``. A dense weight keeps the exact ops it had before (``F.linear``, ``torch.cat``,
``torch.stack``), so a full-precision model runs unchanged."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.checkpoint import CheckpointError
from engine.linear import linear_weight
from engine.quant.kernels import QuantLinear, build
from engine.quant.packed import PackedWeight, cat_rows

Weight = torch.Tensor | QuantLinear


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """``x W^T`` for a dense weight [N, K] or a quantized linear."""
    return F.linear(x, w) if isinstance(w, torch.Tensor) else w(x)


def fused(t: Mapping[str, torch.Tensor | PackedWeight], names: Sequence[str],
          cut: Callable[[Any, str], Any] = lambda w, name: w) -> Weight:
    """The linear layers ``names`` (name prefixes, same input size) as one matmul: their weights'
    rows concatenated in order, each first ``cut(weight, name)`` (a rank's share of it:
    ``engine.parallel.shard.ShardPlan.column`` or ``row``)."""
    parts = [cut(linear_weight(t, n), n) for n in names]
    if all(isinstance(p, torch.Tensor) for p in parts):
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
    if all(isinstance(p, PackedWeight) for p in parts):
        try:
            return build(cat_rows(parts))
        except ValueError as e:
            raise CheckpointError(f"tensors {', '.join(names)} run as one matmul but are stored apart: {e}") from e
    kinds = ", ".join(f"{n} ({'dense' if isinstance(p, torch.Tensor) else p.format})" for n, p in zip(names, parts,
                                                                                                        strict=True))
    raise CheckpointError(f"tensors run as one matmul must be all quantized or all dense, got {kinds}; "
                          "list them together in quantization_config.ignore or in one config group")


def stacked(weights: Sequence[Weight]) -> torch.Tensor | tuple[Weight, ...]:
    """Experts' weights: one [E, N, K] tensor when all are dense, else a tuple indexed by expert."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.stack(list(weights))
    return tuple(weights)
