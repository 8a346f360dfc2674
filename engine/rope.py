"""Rotary position embedding of MLA's decoupled rope dims: plain RoPE and YaRN, interleaved or not.

Owns ``RopeConfig`` (what a DeepSeek-V3 ``config.json`` says: ``rope_theta``, ``rope_scaling``,
``rope_interleave``) and ``Rotary``, which turns positions into angles and rotates the rope part
of queries and keys. The rules follow the DeepSeek-V3 reference (transformers'
``DeepseekV3ForCausalLM`` and ``_compute_yarn_parameters``):

- YaRN blends each frequency between interpolation (``theta^-2i/d / factor``) and
  extrapolation (``theta^-2i/d``) by a linear ramp over the dims between the correction dims of
  ``beta_fast`` and ``beta_slow`` rotations in ``original_max_position_embeddings`` tokens;
- the rotated values are multiplied by ``attention_factor`` (given, or
  ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``), and the softmax scale by
  ``mscale(factor, mscale_all_dim)^2`` (``softmax_scale_factor``), with
  ``mscale(s, m) = 0.1 * m * ln(s) + 1`` (1 for s <= 1).

Layout of a rotated vector of d dims (d/2 frequencies f_0..f_{d/2-1})::

    interleave=True   input pairs (x0, x1), (x2, x3), ...  each rotated by one frequency;
                      output [ rotated x0, x2, ... (d/2) | rotated x1, x3, ... (d/2) ]
    interleave=False  input halves pair up: (x_i, x_{i+d/2}) rotated by f_i; same output order

Stateless after construction; thread-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term ``0.1 * mscale * ln(scale) + 1`` (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """One model's rotary embedding. ``yarn_factor`` None is plain RoPE."""

    theta: float
    interleave: bool = True
    yarn_factor: float | None = None
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"config.json: rope_theta must be positive, got {self.theta}")
        if self.yarn_factor is not None and self.yarn_factor <= 0:
            raise ValueError(f"config.json: rope_scaling.factor must be positive, got {self.yarn_factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("config.json: rope_scaling.original_max_position_embeddings must be positive, "
                             f"got {self.original_max_position_embeddings}")

    @property
    def rotated_value_factor(self) -> float:
        """What the rotated values (cos and sin) are multiplied by."""
        if self.yarn_factor is None:
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.yarn_factor, self.mscale) / yarn_mscale(self.yarn_factor, self.mscale_all_dim)
        return yarn_mscale(self.yarn_factor)

    @property
    def softmax_scale_factor(self) -> float:
        """What the softmax scale ``qk_head_dim^-1/2`` is multiplied by."""
        if self.yarn_factor is None or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.yarn_factor, self.mscale_all_dim) ** 2

    def inv_freq(self, dim: int) -> torch.Tensor:
        """The d/2 angular frequencies [dim // 2] (fp32) of a ``dim``-wide rope part."""
        base = self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        extrapolated = 1.0 / base
        if self.yarn_factor is None:
            return extrapolated
        interpolated = 1.0 / (self.yarn_factor * base)
        low, high = self._correction_range(dim)
        if low == high:
            high += 0.001  # the reference's guard against a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate (low ones)
        return interpolated * (1 - keep) + extrapolated * keep

    def _correction_range(self, dim: int) -> tuple[float, float]:
        def correction_dim(rotations: float) -> float:
            n = self.original_max_position_embeddings
            return dim * math.log(n / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)


class Rotary:
    """Rotates the rope part of queries and keys at given positions, for one model."""

    def __init__(self, cfg: RopeConfig, dim: int, device: str | torch.device = "cpu"):
        if dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for rotary embedding, got {dim}")
        self.cfg, self.dim = cfg, dim
        self.inv_freq = cfg.inv_freq(dim).to(device)
        self.value_factor = cfg.rotated_value_factor

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [N, dim/2] in ``dtype`` for positions [N], rotated-value factor included.
        Computed once per forward and shared by every MLA layer."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        return (freqs.cos() * self.value_factor).to(dtype), (freqs.sin() * self.value_factor).to(dtype)

    def rotate(self, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [N, ..., dim] rotated per position (angles from ``angles``); the output layout is in the
        module docstring. Returns a new tensor."""
        cos, sin = angles
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if self.cfg.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
