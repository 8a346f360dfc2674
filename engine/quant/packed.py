"""``PackedWeight``: one quantized linear weight as loaded, 4-bit codes plus per-group scales.

Owns the resident form every quantized linear starts from and the fusion of linears that run
as one matmul (an expert's gate and up projections). Layout, the same for both formats::

    codes  uint8 [N, K/2]      byte j of row n = code of (n, 2j) | code of (n, 2j+1) << 4
    scale  [N, K/group_size]   INT4: the checkpoint's float scale; MXFP4: e8m0 bytes (2^(s-127))
    value(n, k) = codebook[code(n, k)] * scale(n, k // group_size)

INT4 codes are the symmetric value + 8 (the checkpoint's own offset), so its codebook is
-8..7; MXFP4 codes are e2m1 (sign bit 3), its codebook compressed-tensors' e2m1 table.
``to(device, dtype)`` only moves the tensors and records the compute dtype: the matmul
form (``engine.quant.kernels``) is built once, by ``fused``, after rows are concatenated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.quant.formats import INT4, MXFP4


@dataclass(frozen=True)
class PackedWeight:
    format: str  # INT4 or MXFP4
    group_size: int
    codes: torch.Tensor  # uint8 [N, K/2]
    scale: torch.Tensor  # [N, K/group_size]: float (INT4) or uint8 e8m0 (MXFP4)
    compute_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        n, half_k = self.codes.shape
        assert self.format in (INT4, MXFP4), self.format
        assert self.codes.dtype == torch.uint8, self.codes.dtype
        assert tuple(self.scale.shape) == (n, 2 * half_k // self.group_size), (self.scale.shape, self.codes.shape)

    @property
    def shape(self) -> tuple[int, int]:
        """The dense weight's shape [out_features, in_features]."""
        return (self.codes.shape[0], 2 * self.codes.shape[1])

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def narrow(self, dim: int, start: int, length: int) -> PackedWeight:
        """Rows (``dim`` 0) or input columns (``dim`` 1) ``[start, start + length)`` of the dense
        weight, as ``torch.Tensor.narrow`` (copied, so the whole weight can be freed): a tensor-
        parallel rank's share. Columns must fall on whole scale groups."""
        if dim == 0:
            codes, scale = self.codes.narrow(0, start, length), self.scale.narrow(0, start, length)
        elif start % self.group_size or length % self.group_size:
            raise ValueError(f"{self.format} weight {list(self.shape)}: columns [{start}, {start + length}) do not "
                             f"fall on its scale groups of {self.group_size}")
        else:
            codes = self.codes.narrow(1, start // 2, length // 2)
            scale = self.scale.narrow(1, start // self.group_size, length // self.group_size)
        return dataclasses.replace(self, codes=codes.contiguous().clone(), scale=scale.contiguous().clone())

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> PackedWeight:
        """Moved to ``device``, to be computed in ``dtype``; the codes and scales keep their types."""
        return dataclasses.replace(self, codes=self.codes.to(device), scale=self.scale.to(device),
                                   compute_dtype=dtype or self.compute_dtype)

    def fingerprint_sample(self) -> torch.Tensor:
        """A few codes and scales as float32, for a model's fingerprint."""
        return torch.cat([self.codes.reshape(-1)[:64].float(), self.scale.reshape(-1)[:64].float()])


def from_values(format: str, values: torch.Tensor, scale: torch.Tensor, group_size: int) -> PackedWeight:
    """INT4 from symmetric integer values [N, K] in [-8, 7] (as compressed-tensors unpacks them)."""
    assert format == INT4 and values.dtype == torch.int8, (format, values.dtype)
    return PackedWeight(format, group_size, pack_nibbles((values.to(torch.int16) + 8).to(torch.uint8)), scale)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15, uint8) two per byte, the even column in the low nibble: [N, K/2]."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_nibbles``: uint8 [N, K/2] -> codes [N, K]."""
    return torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)


def cat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Row-wise concatenation (one matmul for several linears of the same input)."""
    first = parts[0]
    for p in parts[1:]:
        if (p.format, p.group_size, p.shape[1], p.scale.dtype) != (first.format, first.group_size,
                                                                   first.shape[1], first.scale.dtype):
            raise ValueError(f"cannot fuse {first.format}/g{first.group_size} {list(first.shape)} with "
                             f"{p.format}/g{p.group_size} {list(p.shape)}")
    if len(parts) == 1:
        return first
    return dataclasses.replace(first, codes=torch.cat([p.codes for p in parts]),
                               scale=torch.cat([p.scale for p in parts]))
