"""KDA state between its canonical layout and a tensor-parallel rank's share of it.

Owns the two cuts and their inverses. The canonical layout is the one the KV store, the
transfer engine and a single-rank engine use (``engine.cache``); a rank of tp holds the
heads ``[t * H/tp, (t+1) * H/tp)``::

    state  canonical [L, H, Dk, Dv]          rank t: [L, H/tp, Dk, Dv]         (a slice of heads)
    conv   canonical [L, K-1, q(H*D) | k(H*D) | v(H*D)]
           rank t:    [L, K-1, q(Ht*D) | k(Ht*D) | v(Ht*D)]  with Ht = H/tp     (three slices)

``L`` is any leading batch of layers. Pure functions; each returns new tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def state_part(state: torch.Tensor, tp: int, t: int) -> torch.Tensor:
    """Rank t's heads of a canonical state ``[..., H, Dk, Dv]``."""
    heads = state.shape[-3]
    if heads % tp:
        raise ValueError(f"KDA state of {heads} heads does not split over tp={tp}")
    n = heads // tp
    return state[..., t * n : (t + 1) * n, :, :].contiguous()


def conv_part(conv: torch.Tensor, tp: int, t: int, head_dim: int) -> torch.Tensor:
    """Rank t's channels of a canonical conv window ``[..., K-1, 3*H*D]``."""
    lead, channels = conv.shape[:-1], conv.shape[-1]
    heads = channels // (3 * head_dim)
    if heads * 3 * head_dim != channels or heads % tp:
        raise ValueError(f"KDA conv window of {channels} channels (head dim {head_dim}) does not split over tp={tp}")
    n = heads // tp
    qkv = conv.reshape(*lead, 3, heads, head_dim)[..., t * n : (t + 1) * n, :]
    return qkv.reshape(*lead, 3 * n * head_dim).contiguous()


def merge_states(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The canonical state from every tp rank's part, in tp order."""
    return torch.cat(list(parts), dim=-3)


def merge_convs(parts: Sequence[torch.Tensor], head_dim: int) -> torch.Tensor:
    """The canonical conv window from every tp rank's part, in tp order."""
    lead = parts[0].shape[:-1]
    split = [p.reshape(*lead, 3, -1, head_dim) for p in parts]
    qkv = torch.cat(split, dim=-2)
    return qkv.reshape(*lead, -1)
