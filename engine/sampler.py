"""Token sampling that is a pure function of (logits, params, seed, position).

Owns ``sample``, over ``SamplingParams`` (``engine.sampling_params``: validated once, with
messages that name the field and the limit; a frozen value with no torch, so the Conductor
and the simulator read it without importing torch). The random draw for a request at
sequence position p comes from a generator seeded by (seed, p) alone, so a request samples
the same token alone or in any batch, in one process or across the cluster.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams


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
