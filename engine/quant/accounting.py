"""Resident weight bytes of a built model: every tensor it holds, each storage counted once.

Owns the figure bench/engine.py reports and the tests bound: ``weight_bytes(model)`` walks the
model's objects (dataclasses, lists, engine classes) and sums the bytes of the distinct tensor
storages it reaches; ``routed_experts`` is the same over the MoE layers' expert weights only
(the layers K2-Thinking and K3 quantize). Read-only; no side effects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class WeightBytes:
    total: int
    routed_experts: int


def weight_bytes(model: Any) -> WeightBytes:
    experts: dict[int, int] = {}
    for blk in model.blocks:
        w = getattr(blk.ffn, "w", None)
        if w is not None and hasattr(w, "w13"):
            _walk((w.w13, w.w2), experts, set())
    everything: dict[int, int] = {}
    _walk(model, everything, set())
    return WeightBytes(sum(everything.values()), sum(experts.values()))


def _walk(obj: Any, storages: dict[int, int], seen: set[int]) -> None:
    """Adds each tensor storage reachable from ``obj`` (data pointer -> bytes)."""
    if isinstance(obj, torch.Tensor):
        s = obj.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return
    if id(obj) in seen or obj is None or isinstance(obj, str | int | float | bool | torch.dtype | torch.device):
        return
    seen.add(id(obj))
    if isinstance(obj, list | tuple | set | frozenset):
        children: Any = obj
    elif isinstance(obj, dict):
        children = obj.values()
    elif dataclasses.is_dataclass(obj):
        children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif type(obj).__module__.startswith("engine.") and hasattr(obj, "__dict__"):
        children = vars(obj).values()
    else:
        return
    for child in children:
        _walk(child, storages, seen)
