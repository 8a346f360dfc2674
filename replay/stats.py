"""Latency statistics of token timelines: TBT (Mooncake's definition), ITL, percentiles.

Pure functions over plain sequences of seconds; no I/O, no clocks.

- ``token_intervals``: gaps between consecutive output tokens (the first token's time is TTFT,
  not an interval), so ``n`` tokens give ``n-1`` intervals; ``interval_array`` the same gaps
  as a float64 array (the same subtractions, done by numpy: a run's summary takes every
  token's).
- ``tbt_s``: Mooncake (FAST'25) time between tokens, the mean of the longest 10% of a
  request's intervals (at least one interval), so a few slow steps count, as a user feels them.
- ``percentile``: linear interpolation between closest ranks (numpy's default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TBT_TAIL_FRACTION = 0.10


def token_intervals(token_times_s: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(token_times_s, token_times_s[1:], strict=False)]


def interval_array(token_times_s: Sequence[float]) -> np.ndarray:
    """``token_intervals`` as a float64 array, equal value for value."""
    return np.diff(np.asarray(token_times_s, dtype=np.float64))


def tbt_s(token_times_s: Sequence[float], tail_fraction: float = TBT_TAIL_FRACTION) -> float | None:
    """Mean of the longest ``ceil(tail_fraction * n)`` of the ``n`` intervals; None below 2 tokens."""
    return tbt_of_intervals(token_intervals(token_times_s), tail_fraction)


def tbt_of_intervals(gaps: Sequence[float], tail_fraction: float = TBT_TAIL_FRACTION) -> float | None:
    """``tbt_s`` of the token times these are the intervals of (for a caller that has them: a
    sequence or an array). The longest ``k`` in ascending order, as ``sorted`` gives them, so
    the mean sums the same values in the same order either way."""
    if not len(gaps):
        return None
    k = max(1, math.ceil(round(tail_fraction * len(gaps), 9)))
    return float(np.sort(np.asarray(gaps, dtype=np.float64))[-k:].mean())


def mean_itl_s(token_times_s: Sequence[float]) -> float | None:
    """Plain inter-token latency of one request: the mean interval; None below 2 tokens."""
    gaps = token_intervals(token_times_s)
    return float(np.mean(gaps)) if gaps else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation; None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


@dataclass(frozen=True)
class LatencyStats:
    """Distribution of one latency in seconds; every field None when ``count`` is 0."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyStats:
        if not len(values):
            return cls(0, None, None, None, None, None)
        return cls(len(values), float(np.mean(values)), percentile(values, 50), percentile(values, 90),
                   percentile(values, 99), float(np.max(values)))


def meets_slo(ttft: float | None, tbt: float | None, ttft_slo_s: float | None, tbt_slo_s: float | None) -> bool:
    """A finished request meets its SLOs when TTFT <= ttft_slo and TBT <= tbt_slo; an absent SLO
    is no constraint, and a request of one token has no TBT to miss."""
    if ttft is None:
        return False
    if ttft_slo_s is not None and ttft > ttft_slo_s:
        return False
    return tbt_slo_s is None or tbt is None or tbt <= tbt_slo_s
