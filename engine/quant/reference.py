"""The quantized formats as compressed-tensors writes and reads them: the reference side.

Owns writing a quantized checkpoint's tensors from dense ones (the library's ``calculate_qparams``
for the scales and its compressors for the packing), the matching ``quantization_config`` block
of config.json, and the dequantized weights the library's own decompression gives (the
reference the engine's quantized paths are tested against). Tests and bench/engine.py use it;
serving never does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.quant.formats import INT4, MXFP4, QuantConfig
from engine.quant.loader import is_linear

# K2-Thinking's ignore list: only routed experts are quantized (the patterns fit Kimi-Linear's names too).
EXPERTS_ONLY = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*")


def quantization_config(format: str, ignore: Sequence[str] = EXPERTS_ONLY, group_size: int = 32) -> dict[str, Any]:
    """A config.json ``quantization_config`` with one weight-only group targeting ``Linear``."""
    weights: dict[str, Any] = {"num_bits": 4, "type": "int" if format == INT4 else "float", "symmetric": True,
                               "strategy": "group", "group_size": group_size, "dynamic": False, "actorder": None}
    if format == MXFP4:
        weights["scale_dtype"] = "torch.uint8"
    return {
        "quant_method": "compressed-tensors", "format": format, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": list(ignore), "kv_cache_scheme": None,
    }


def _compressor(format: str) -> Any:
    if format == INT4:
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

        return PackedQuantizationCompressor
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor

    return MXFP4PackedCompressor


def _quantized_modules(qcfg: QuantConfig, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[str, Any]]:
    """module name -> (format, compressed-tensors scheme) for every linear the config quantizes."""
    schemes = dict(qcfg.groups)
    out = {}
    for name, shape in shapes.items():
        if is_linear(name, shape):
            module = name.removesuffix(".weight")
            s = qcfg.scheme_for(module, f"tensor {module}")
            if s is not None:
                out[module] = (s.format, schemes[s.group_name])
    return out


def quantize(tensors: Mapping[str, torch.Tensor], qconfig: dict[str, Any],
             shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors for ``qconfig``: each quantized linear's dense ``M.weight`` (cast to
    bf16, as checkpoints hold it) becomes the compressor's parts; the rest is unchanged."""
    from compressed_tensors.quantization.utils import calculate_qparams

    out = dict(tensors)
    for module, (fmt, scheme) in _quantized_modules(QuantConfig.from_dict(qconfig, "quantization_config"),
                                                    shapes).items():
        w = out.pop(module + ".weight").to(torch.bfloat16)
        g = scheme.weights.group_size
        groups = w.float().view(w.shape[0], w.shape[1] // g, g)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        state = _compressor(fmt).compress({"weight": w, "weight_scale": scale.to(torch.bfloat16)}, scheme)
        out.update({f"{module}.{k}": v.contiguous() for k, v in state.items()})
    return out


def dequantize(tensors: Mapping[str, torch.Tensor], qconfig: dict[str, Any],
               shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors back to dense ``M.weight`` (float32) by compressed-tensors' decompression.

    INT4 scales are handed over in float32 so the library's product ``value * scale`` is exact
    (in the checkpoint's bf16 it would round); MXFP4 products are exact in any float type."""
    out = dict(tensors)
    for module, (fmt, scheme) in _quantized_modules(QuantConfig.from_dict(qconfig, "quantization_config"),
                                                    shapes).items():
        state = {k: out.pop(f"{module}.{k}") for k in ("weight_packed", "weight_scale", "weight_shape")
                 if f"{module}.{k}" in out}
        if fmt == INT4:
            state["weight_scale"] = state["weight_scale"].float()
        out[module + ".weight"] = _compressor(fmt).decompress(state, scheme)["weight"].float()
    return out


def write_quantization_config(directory: str | Path, qconfig: dict[str, Any]) -> None:
    """Adds ``quantization_config`` to an existing ``directory/config.json``."""
    path = Path(directory) / "config.json"
    raw = json.loads(path.read_text())
    raw["quantization_config"] = qconfig
    path.write_text(json.dumps(raw, indent=2))
