"""Time series derived from ``RequestRecord``s: per-worker queue/running, cache ratio, admissions.

Pure numpy functions on the replay clock (seconds from replay start); the plots draw them and
the simulator's analyses (load oscillation) can reuse them. Per-worker occupancy comes from
the per-request intervals alone::

    arrival_s      +queue_s          +ttft_s                       +latency_s
       |-- queued --|-- prefilling --|---------- decoding ----------|
       (prefill worker)              (decode worker)

``queue_s`` is the server's report (0 when absent, so queue time counts as prefilling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from replay.records import FINISHED, REJECTED, RequestRecord


@dataclass(frozen=True)
class Occupancy:
    """Requests held by one worker at each grid time: ``queued`` (prefill only) and ``running``."""

    role: str  # prefill | decode
    worker: str
    queued: np.ndarray
    running: np.ndarray


def time_grid(records: Sequence[RequestRecord], num_points: int = 400) -> np.ndarray:
    end = max((r.end_s for r in records), default=0.0)
    return np.linspace(0.0, max(end, 1e-6), num_points)


def concurrency(intervals: Sequence[tuple[float, float]], grid: np.ndarray) -> np.ndarray:
    """How many half-open intervals ``[start, end)`` hold each grid time."""
    if not intervals:
        return np.zeros(grid.shape, dtype=np.int64)
    starts = np.sort(np.fromiter((a for a, _ in intervals), dtype=np.float64))
    ends = np.sort(np.fromiter((b for _, b in intervals), dtype=np.float64))
    return np.searchsorted(starts, grid, side="right") - np.searchsorted(ends, grid, side="right")


def _phases(r: RequestRecord) -> tuple[float, float, float, float]:
    """(arrival, prefill start, first token, end) on the replay clock."""
    end = r.end_s
    first = r.arrival_s + r.ttft_s if r.ttft_s is not None else end
    start = min(r.arrival_s + (r.queue_s or 0.0), first)
    return r.arrival_s, start, first, end


def worker_occupancy(records: Sequence[RequestRecord], grid: np.ndarray) -> list[Occupancy]:
    """One ``Occupancy`` per worker seen in the records, prefill workers first, sorted by id."""
    queued: dict[str, list] = {}
    prefilling: dict[str, list] = {}
    decoding: dict[str, list] = {}
    for r in records:
        arrival, start, first, end = _phases(r)
        if r.prefill_worker:
            queued.setdefault(r.prefill_worker, []).append((arrival, start))
            prefilling.setdefault(r.prefill_worker, []).append((start, first))
        if r.decode_worker and r.ttft_s is not None:
            decoding.setdefault(r.decode_worker, []).append((first, end))
    zeros = np.zeros(grid.shape, dtype=np.int64)
    out = [Occupancy("prefill", w, concurrency(queued[w], grid), concurrency(prefilling[w], grid))
           for w in sorted(prefilling)]
    out += [Occupancy("decode", w, zeros, concurrency(decoding[w], grid)) for w in sorted(decoding)]
    return out


def _bins(records: Sequence[RequestRecord], bin_s: float | None, num_bins: int) -> np.ndarray:
    end = max((r.end_s for r in records), default=0.0)
    width = bin_s or max(end / num_bins, 1e-3)
    return np.arange(0.0, end + width, width) if end > 0 else np.array([0.0, width])


def cached_ratio_over_time(records: Sequence[RequestRecord], bin_s: float | None = None,
                           num_bins: int = 40) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin starts, ratio per bin, cumulative ratio) over finished requests by their end time;
    NaN in a bin where nothing finished."""
    edges = _bins(records, bin_s, num_bins)
    done = [r for r in records if r.outcome == FINISHED]
    ends = np.array([r.end_s for r in done], dtype=np.float64)
    prompt = np.array([r.prompt_tokens or r.prompt_len for r in done], dtype=np.float64)
    cached = np.array([r.cached_tokens for r in done], dtype=np.float64)
    which = np.clip(np.searchsorted(edges, ends, side="right") - 1, 0, len(edges) - 1)
    p = np.bincount(which, weights=prompt, minlength=len(edges))
    c = np.bincount(which, weights=cached, minlength=len(edges))
    with np.errstate(invalid="ignore", divide="ignore"):
        return edges, np.where(p > 0, c / p, np.nan), np.where(np.cumsum(p) > 0, np.cumsum(c) / np.cumsum(p), np.nan)


def admissions_over_time(records: Sequence[RequestRecord], bin_s: float | None = None,
                         num_bins: int = 40) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin starts, admitted arrivals per bin, rejected arrivals per bin), by ``arrival_s``;
    everything not rejected counts as admitted."""
    edges = _bins(records, bin_s, num_bins)
    arrivals = np.array([r.arrival_s for r in records], dtype=np.float64)
    rejected = np.array([r.outcome == REJECTED for r in records], dtype=bool)
    which = np.clip(np.searchsorted(edges, arrivals, side="right") - 1, 0, len(edges) - 1)
    rej = np.bincount(which[rejected], minlength=len(edges))
    adm = np.bincount(which[~rejected], minlength=len(edges))
    return edges, adm, rej
