"""Block payloads: one block's cache as a value.

Owns ``BlockPayload`` (one block's MLA latent rows for every MLA layer, plus an optional KDA
snapshot taken at the block's end), the checks every payload passes when built (shapes, layer
counts, ids and fingerprint lengths that fit the header's u16 fields, supported dtypes with
their codes), bit-exact comparison, and ``make_random_payload`` for tests and benchmarks. A
model without KDA layers carries an empty snapshot (zero layers, zero bytes) on every block,
so every block is resumable, as it is for the hybrid.

The byte format every tier, file and transfer uses for a payload lives in
``kvstore.payload_format``, which imports this module (never the reverse).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_MAX_U16 = 0xFFFF


# The supported tensor dtypes and their codes in the encoded header (``payload_format``): kept
# here, as a payload refuses any other dtype when built, and the format imports this module.
@cache
def _dtype_codes() -> dict[torch.dtype, int]:
    # Made on first use: torch loads when a tensor is encoded or decoded, not when the module
    # is imported (the simulator's sized store imports this module and never touches a tensor).
    import torch

    return {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


def _tensor_nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclasses.dataclass(frozen=True, eq=False)
class BlockPayload:
    """One block's cache: MLA rows of every MLA layer and optionally a KDA snapshot.

    ``mla``: ``[num_mla_layers, block_size, latent_dim]``; ``kda_state``:
    ``[num_kda_layers, heads, key_dim, value_dim]``; ``kda_conv``:
    ``[num_kda_layers, kernel - 1, channels]``. Both KDA tensors are present or neither.
    The dataclass is frozen but tensors are not: callers must not write into them after
    handing a payload to a store. Tensors may live on any device; encoding copies to host.
    """

    model_fingerprint: str
    mla: torch.Tensor
    mla_layer_ids: tuple[int, ...]
    kda_state: torch.Tensor | None = None
    kda_conv: torch.Tensor | None = None
    kda_layer_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "mla_layer_ids", tuple(int(i) for i in self.mla_layer_ids))
        object.__setattr__(self, "kda_layer_ids", tuple(int(i) for i in self.kda_layer_ids))
        _check_tensor("mla", self.mla, 3, len(self.mla_layer_ids))
        if (self.kda_state is None) != (self.kda_conv is None):
            raise ValueError("kda_state and kda_conv must be given together (a snapshot has both)")
        if self.kda_state is not None:
            _check_tensor("kda_state", self.kda_state, 4, len(self.kda_layer_ids))
            _check_tensor("kda_conv", self.kda_conv, 3, len(self.kda_layer_ids))
        elif self.kda_layer_ids:
            raise ValueError(f"kda_layer_ids {self.kda_layer_ids} given without a KDA snapshot")
        for name, ids in (("mla_layer_ids", self.mla_layer_ids), ("kda_layer_ids", self.kda_layer_ids)):
            if any(not 0 <= i <= _MAX_U16 for i in ids):
                raise ValueError(f"{name} must lie in [0, {_MAX_U16}], got {ids}")
        if len(self.model_fingerprint.encode()) > _MAX_U16:
            raise ValueError(f"model fingerprint longer than {_MAX_U16} bytes")

    @property
    def has_snapshot(self) -> bool:
        return self.kda_state is not None

    @property
    def block_size(self) -> int:
        return self.mla.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (MLA rows plus snapshot), without header or padding."""
        return _tensor_nbytes(self.mla) + _tensor_nbytes(self.kda_state) + _tensor_nbytes(self.kda_conv)

    def same_as(self, other: BlockPayload) -> bool:
        """True when both hold the same metadata and bit-identical tensors."""
        if (self.model_fingerprint, self.mla_layer_ids, self.kda_layer_ids) != (
            other.model_fingerprint,
            other.mla_layer_ids,
            other.kda_layer_ids,
        ):
            return False
        pairs = ((self.mla, other.mla), (self.kda_state, other.kda_state), (self.kda_conv, other.kda_conv))
        return all(_bit_equal(a, b) for a, b in pairs)


def _bit_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    import torch

    return bool(torch.equal(_as_bytes(a), _as_bytes(b)))


def _check_tensor(name: str, t: torch.Tensor | None, ndim: int, num_layers: int) -> None:
    assert t is not None
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.shape[0] != num_layers:
        raise ValueError(f"{name} has {t.shape[0]} layers but {num_layers} layer ids")
    if t.dtype not in _dtype_codes():
        raise ValueError(f"{name} dtype {t.dtype} unsupported; use one of {sorted(map(str, _dtype_codes()))}")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor (a view when already contiguous on CPU)."""
    import torch

    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def make_random_payload(
    generator: torch.Generator,
    *,
    model_fingerprint: str = "test-model",
    mla_layer_ids: Sequence[int] = (3, 7),
    block_size: int = 4,
    latent_dim: int = 8,
    kda_layer_ids: Sequence[int] = (),
    kda_heads: int = 2,
    kda_head_dim: int = 4,
    conv_rows: int = 3,
    dtype: torch.dtype | None = None,
) -> BlockPayload:
    """A payload of seeded random values, for tests and benchmarks (snapshot when
    ``kda_layer_ids`` is non-empty; conv channels are ``3 * heads * head_dim``; ``dtype``
    of the MLA rows, float32 when None)."""
    import torch

    dtype = dtype or torch.float32
    mla = torch.randn(len(mla_layer_ids), block_size, latent_dim, generator=generator).to(dtype)
    state = conv = None
    if kda_layer_ids:
        n = len(kda_layer_ids)
        state = torch.randn(n, kda_heads, kda_head_dim, kda_head_dim, generator=generator)
        conv = torch.randn(n, conv_rows, 3 * kda_heads * kda_head_dim, generator=generator)
    return BlockPayload(model_fingerprint, mla, tuple(mla_layer_ids), state, conv, tuple(kda_layer_ids))


__all__ = [
    "BlockPayload",
    "make_random_payload",
]
