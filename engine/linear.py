"""Linear layers' weights, built from the checkpoint's tensors by the layer's name.

Owns ``linear_weight``: every linear layer of the model (attention projections, MLPs, experts,
the LM head) gets its weight here from the tensors under its name prefix
(``model.layers.3.mlp.gate_proj`` -> ``...gate_proj.weight``), mirroring ``engine.checkpoint.add_linear``
on the schema side. It is the seam where a packed checkpoint format plugs in per layer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def linear_weight(tensors: Mapping[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The ``[out, in]`` weight of the linear layer named ``prefix`` (already in the model's dtype
    and device). For a layer a checkpoint quantizes it is an ``engine.quant.PackedWeight``; the
    feed-forward layers take those through ``engine.quant.ops.fused``, and the loader refuses a
    quantized layer anywhere else."""
    return tensors[prefix + ".weight"]
