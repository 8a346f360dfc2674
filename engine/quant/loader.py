"""Reading quantized linears out of a checkpoint's tensors, all-or-nothing.

Owns the step between "every tensor of the safetensors files" and "the model's tensors by
name": for each linear the quantization_config quantizes, the stored parts (compressed-tensors'
names) are checked and replaced by one ``PackedWeight`` under the linear's ``.weight`` name::

    INT4   M.weight_packed int32 [N, K/8]   M.weight_scale float [N, K/g]   M.weight_shape int [2]
    MXFP4  M.weight_packed uint8 [N, K/2]   M.weight_scale uint8 [N, K/32]  (M.weight_shape optional)

INT4 values are unpacked by compressed-tensors (``unpack_from_int32``); MXFP4 bytes are kept
as stored (that is the resident layout). Every error names the file and the tensor.
Quantized weights run in the feed-forward layers (routed experts, shared experts, dense MLP);
a config that quantizes an attention projection or lm_head is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.checkpoint import CheckpointError
from engine.quant.formats import INT4, LinearScheme, QuantConfig
from engine.quant.packed import PackedWeight, from_values

PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
FEED_FORWARD = (".mlp.", ".block_sparse_moe.")
ROUTER = ".gate.weight"  # the MoE router: a plain parameter in the reference, never quantized


def is_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Whether tensor ``name`` is the weight of a linear layer (a quantization candidate)."""
    return (name.endswith(".weight") and len(shape) == 2 and not name.endswith(ROUTER)
            and name != "model.embed_tokens.weight")


def take_packed(tensors: Mapping[str, torch.Tensor], origin: Mapping[str, str], qcfg: QuantConfig,
                shapes: Mapping[str, tuple[int, ...]], prefix: str = "") -> dict[str, torch.Tensor | PackedWeight]:
    """``tensors`` with each quantized linear's parts replaced by a PackedWeight named ``M.weight``.

    ``origin`` maps a tensor name to its file; ``shapes`` is the config's expected dense shapes;
    ``prefix`` is what the checkpoint puts before the model's names (K2.5's ``language_model.``),
    part of the names ``targets`` and ``ignore`` match. Raises CheckpointError naming the file
    and tensor of the first problem.
    """
    out: dict[str, torch.Tensor | PackedWeight] = dict(tensors)
    for name, shape in shapes.items():
        if not is_linear(name, shape):
            continue
        module = name.removesuffix(".weight")
        file = origin.get(module + ".weight_packed", origin.get(name, "the checkpoint"))
        scheme = qcfg.scheme_for(prefix + module, f"{file}: tensor {prefix}{module}")
        if scheme is None:
            continue
        if not any(part in name for part in FEED_FORWARD):
            raise CheckpointError(
                f"{file}: tensor {module} is quantized ({scheme.format}, {qcfg.source} config group "
                f"{scheme.group_name}); Tidekv runs quantized weights in feed-forward layers only: list "
                "attention projections and lm_head in quantization_config.ignore")
        if name in out:
            raise CheckpointError(f"{origin.get(name)}: tensor {name} is stored dense, but {qcfg.source} quantizes "
                                  f"{module} ({scheme.format}, config group {scheme.group_name}); expected "
                                  f"{module}.weight_packed and {module}.weight_scale")
        out[name] = _read(out, origin, module, scheme, (shape[0], shape[1]))
    stray = sorted(n for n in out if n.rsplit(".", 1)[-1] in PARTS)
    if stray:
        raise CheckpointError(f"{origin.get(stray[0])}: tensor {stray[0]} is a quantized part, but {qcfg.source} "
                              f"leaves {stray[0].rsplit('.', 1)[0]} dense (ignore {list(qcfg.ignore)}), "
                              "or the config has no such layer")
    return out


def _read(out: dict, origin: Mapping[str, str], module: str, scheme: LinearScheme,
          shape: tuple[int, int]) -> PackedWeight:
    n, k = shape
    packed_name = module + ".weight_packed"
    if packed_name not in out:
        raise CheckpointError(f"checkpoint is missing tensor {packed_name}: config group {scheme.group_name} "
                              f"quantizes {module} ({scheme.format}, dense shape {[n, k]})")
    file = origin[packed_name]
    packed = out.pop(packed_name)
    scale = out.pop(module + ".weight_scale", None)
    if scale is None:
        raise CheckpointError(f"checkpoint is missing tensor {module}.weight_scale, the scale of {packed_name} "
                              f"in {file}")
    weight_shape = out.pop(module + ".weight_shape", None)
    if weight_shape is None and scheme.format == INT4:
        raise CheckpointError(f"checkpoint is missing tensor {module}.weight_shape (the dense shape of "
                              f"{packed_name} in {file})")
    if weight_shape is not None and weight_shape.reshape(-1).tolist() != [n, k]:
        raise CheckpointError(f"{origin[module + '.weight_shape']}: tensor {module}.weight_shape is "
                              f"{weight_shape.reshape(-1).tolist()}, the config expects {[n, k]}")
    g = scheme.group_size
    if k % g:
        raise CheckpointError(f"{file}: tensor {packed_name}: group_size {g} (config group {scheme.group_name}) "
                              f"does not divide the input dimension {k}")
    if k % 8:
        raise CheckpointError(f"{file}: tensor {packed_name}: input dimension {k} is not a multiple of 8")
    scale_file = origin[module + ".weight_scale"]
    if scheme.format == INT4:
        _expect(packed, (n, k // 8), (torch.int32,), f"{file}: tensor {packed_name}", f"weight_shape {[n, k]}")
        _expect(scale, (n, k // g), (torch.bfloat16, torch.float16, torch.float32),
                f"{scale_file}: tensor {module}.weight_scale", f"weight_shape {[n, k]} with group_size {g}")
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        return from_values(INT4, unpack_from_int32(packed, 4, torch.Size([n, k])), scale, g)
    _expect(packed, (n, k // 2), (torch.uint8,), f"{file}: tensor {packed_name}", f"dense shape {[n, k]}")
    _expect(scale, (n, k // g), (torch.uint8,), f"{scale_file}: tensor {module}.weight_scale",
            f"dense shape {[n, k]} with group_size {g} (e8m0 bytes)")
    return PackedWeight(scheme.format, g, packed.contiguous(), scale.contiguous())


def _expect(t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], what: str, why: str) -> None:
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        raise CheckpointError(f"{what} is {list(t.shape)} {t.dtype}; {why} needs {list(shape)} "
                              f"{' or '.join(str(d) for d in dtypes)}")
