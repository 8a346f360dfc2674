"""Weight-only 4-bit matmuls: ``y = x W^T`` with W resident as 4-bit codes and group scales.

Two forms, chosen once per linear by ``build`` (measured on this project's CPUs, bf16, one
thread; bench/engine.py reports the model-level figures):

- ``Int4KernelLinear``: torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) on its own
  packed layout, for INT4 with bf16 activations. At 1 row it is 2-3.5x faster than a bf16
  ``F.linear`` on the dense weight (it reads a quarter of the bytes), at 8 rows about even,
  at 64+ rows 2-5x slower (it reuses no weight across rows). The kernel wants scales and zeros interleaved
  ``[K/g, N, 2]``; zeros are 0 for a symmetric scheme, so only the scales stay resident and
  the pair is made per call by zero-extending each bf16 scale to 32 bits (about 3 us).
  Its fp32 and fp16 paths are scalar code (25-80x slower than dense), so never used.
- ``CodebookLinear``: everything else (MXFP4, INT4 in fp32, other devices, shapes the
  kernel refuses). Per call it expands the weight into a transient dense tile (a 256-entry
  table maps each byte to its two values; one gather, one scale multiply) and runs
  ``F.linear``; nothing dense stays resident. The dequantized tile is exactly
  ``codebook[code] * scale``, the value compressed-tensors' own dequantization gives.

Both are immutable after construction and thread-safe.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from engine.quant.formats import INT4, MXFP4
from engine.quant.packed import PackedWeight, unpack_nibbles

KERNEL_GROUP_SIZES = (32, 64, 128, 256)
KERNEL_ROW_MULTIPLE = 16  # the kernel's packing refuses other output sizes


class Int4KernelLinear:
    def __init__(self, w: PackedWeight):
        self.out_features, self.in_features = w.shape
        self.group_size = w.group_size
        values = unpack_nibbles(w.codes).to(torch.int32)  # [N, K], 0..15 = value + 8
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
        # [K/g, N] bf16 bits; per call widened to (scale, 0) pairs.
        self.scale_bits = w.scale.to(torch.bfloat16).t().contiguous().view(torch.uint16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        pairs = self.scale_bits.to(torch.int32).view(torch.bfloat16).view(*self.scale_bits.shape, 2)
        flat = x.reshape(-1, self.in_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, pairs)
        return y.view(*x.shape[:-1], self.out_features)


class CodebookLinear:
    def __init__(self, w: PackedWeight):
        self.out_features, self.in_features = w.shape
        self.group_size = w.group_size
        self.dtype = w.compute_dtype
        self.codes, self.scale = w.codes, w.scale
        self.pairs = _pair_table(w.format, self.dtype, self.codes.device)
        self.scale_table = _e8m0_table(self.dtype, self.codes.device) if w.format == MXFP4 else None

    def dequantize(self) -> torch.Tensor:
        """The dense weight [N, K] in the compute dtype (a fresh tensor, not kept)."""
        n, groups = self.out_features, self.in_features // self.group_size
        # Each byte indexes its pair of values; the int view moves both in one element.
        v = self.pairs.index_select(0, self.codes.reshape(-1).to(torch.int32)).view(self.dtype)
        if self.scale_table is None:
            scale = self.scale.to(self.dtype)
        else:
            scale = self.scale_table.index_select(0, self.scale.reshape(-1).to(torch.int32)).view(n, groups)
        return (v.view(n, groups, self.group_size) * scale.unsqueeze(-1)).view(n, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize())


QuantLinear = Int4KernelLinear | CodebookLinear


def build(w: PackedWeight) -> QuantLinear:
    """The matmul form of a (fused) packed weight, for its compute dtype and device."""
    if (w.format == INT4 and w.compute_dtype == torch.bfloat16 and w.codes.device.type == "cpu"
            and w.group_size in KERNEL_GROUP_SIZES and w.shape[0] % KERNEL_ROW_MULTIPLE == 0
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")):
        return Int4KernelLinear(w)
    return CodebookLinear(w)


def codebook(format: str) -> torch.Tensor:
    """The 16 values a code stands for, float32, indexed by code."""
    if format == INT4:
        return torch.arange(-8, 8, dtype=torch.float32)
    from compressed_tensors.compressors.nvfp4.helpers import kE2M1ToFloat

    magnitudes = kE2M1ToFloat.to(torch.float32)  # codes 0-7; bit 3 is the sign
    return torch.cat([magnitudes, -magnitudes])


@cache
def _pair_table(format: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256] integers, each holding the two ``dtype`` values of one code byte (low nibble first)."""
    cb = codebook(format).to(dtype)
    pairs = torch.stack([cb.repeat(16), cb.repeat_interleave(16)], -1).contiguous()
    wide = {2: torch.int32, 4: torch.int64}[pairs.element_size()]
    return pairs.view(wide).view(256).to(device)


@cache
def _e8m0_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256] scale values of the e8m0 bytes, decoded by compressed-tensors."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale

    return decompress_mx_scale(torch.arange(256, dtype=torch.int32).to(torch.uint8)).to(dtype).to(device)
