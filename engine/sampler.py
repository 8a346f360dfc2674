"""Token sampling that is a pure function of (logits, params, seed, position).

Owns ``SamplingParams`` (validated once, with messages that name the field and the limit) and
``sample``. The random draw for a request at sequence position p comes from a generator
seeded by (seed, p) alone, so a request samples the same token alone or in any batch, in one
process or across the cluster.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def validate(self, vocab_size: int, max_new_tokens_limit: int = 1 << 20) -> None:
        """Raises ValueError naming the first bad field and its limit."""
        if not 1 <= self.max_new_tokens <= max_new_tokens_limit:
            raise ValueError(f"max_new_tokens must be in [1, {max_new_tokens_limit}], got {self.max_new_tokens}")
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.top_k <= vocab_size):
            raise ValueError(f"top_k must be in [0, {vocab_size}], got {self.top_k}")
        if not (0 <= self.seed < 1 << 63):
            raise ValueError(f"seed must be in [0, 2^63), got {self.seed}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {bad[0]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _position_seed(seed: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[int]:
    """One token per row of logits [B, V] (float32); positions[b] is the index the token will take."""
    greedy = logits.argmax(-1).tolist()
    out = []
    for b, p in enumerate(params):
        out.append(greedy[b] if p.greedy else _sample_row(logits[b], p, positions[b]))
    return out


def _sample_row(row: torch.Tensor, p: SamplingParams, position: int) -> int:
    scaled = row.float().cpu() / p.temperature
    if p.top_k:
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -torch.inf)
    if p.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= p.top_p
        scaled[order[drop]] = -torch.inf
    gen = torch.Generator().manual_seed(_position_seed(p.seed, position))
    u = torch.rand(scaled.shape, generator=gen, dtype=torch.float64).clamp_min(1e-300)
    gumbel = -torch.log(-torch.log(u))
    return int((scaled.double() + gumbel).argmax())
