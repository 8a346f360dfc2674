"""PNG plots of a report (matplotlib, Agg backend: no display needed).

``plot_report(out_dir, records)`` writes the five plots of one run and returns their paths;
``plot_compare(out_dir, runs)`` overlays the TTFT and TBT CDFs of several labelled runs.
Each function opens and closes its own figures (no global pyplot state is left behind).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend choice)
import numpy as np  # noqa: E402

from replay.records import FINISHED, RequestRecord  # noqa: E402
from replay.stats import tbt_s  # noqa: E402
from replay.timeline import admissions_over_time, cached_ratio_over_time, time_grid, worker_occupancy  # noqa: E402

PLOT_FILES = ("ttft_cdf.png", "tbt_cdf.png", "cached_ratio.png", "worker_load.png", "admissions.png")
DPI = 100


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _cdf(ax, values: Sequence[float], label: str) -> None:
    if not values:
        ax.plot([], [], label=f"{label} (none)")
        return
    xs = np.sort(np.asarray(values, dtype=np.float64))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=f"{label} (n={len(xs)})")


def _ttfts(records: Sequence[RequestRecord]) -> list[float]:
    return [r.ttft_s for r in records if r.outcome == FINISHED and r.ttft_s is not None]


def _tbts(records: Sequence[RequestRecord]) -> list[float]:
    return [t for t in (tbt_s(r.token_times_s) for r in records if r.outcome == FINISHED) if t is not None]


def _cdf_plot(path: Path, runs: Mapping[str, Sequence[float]], xlabel: str, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in runs.items():
        _cdf(ax, values, label)
    ax.set(xlabel=xlabel, ylabel="fraction of requests", title=title, ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def _cached_plot(path: Path, records: Sequence[RequestRecord]) -> Path:
    edges, per_bin, cumulative = cached_ratio_over_time(records)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(edges, per_bin, "o", ms=3, label="per bin (by end time)")
    ax.plot(edges, cumulative, "-", label="cumulative")
    ax.set(xlabel="replay time (s)", ylabel="cached tokens / prompt tokens", title="Cached-token ratio",
           ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    return _save(fig, path)


def _load_plot(path: Path, records: Sequence[RequestRecord]) -> Path:
    grid = time_grid(records)
    occupancy = worker_occupancy(records, grid)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for o in occupancy:
        if o.role == "prefill":
            top.plot(grid, o.running, label=f"{o.worker} prefilling (worker queue + compute)")
            top.plot(grid, o.queued, "--", label=f"{o.worker} queued (Conductor)")
        else:
            bottom.plot(grid, o.running, label=f"{o.worker} decoding")
    top.set(ylabel="requests", title="Prefill workers: queued / running")
    bottom.set(xlabel="replay time (s)", ylabel="requests", title="Decode workers: running")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize="small")
    return _save(fig, path)


def _admission_plot(path: Path, records: Sequence[RequestRecord]) -> Path:
    edges, admitted, rejected = admissions_over_time(records)
    width = edges[1] - edges[0] if len(edges) > 1 else 1.0
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(edges, admitted, width=width, align="edge", label="admitted")
    ax.bar(edges, rejected, width=width, align="edge", bottom=admitted, label="rejected")
    ax.set(xlabel="replay time (s, by arrival)", ylabel="requests per bin", title="Admitted vs rejected")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    return _save(fig, path)


def plot_report(out_dir: str | Path, records: Sequence[RequestRecord]) -> list[Path]:
    """Writes ``PLOT_FILES`` under ``out_dir``; returns their paths in that order."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = iter(PLOT_FILES)
    return [
        _cdf_plot(out / next(names), {"TTFT": _ttfts(records)}, "TTFT (s)", "TTFT CDF (finished requests)"),
        _cdf_plot(out / next(names), {"TBT": _tbts(records)}, "TBT (s, mean of the slowest 10% intervals)",
                  "TBT CDF (finished requests)"),
        _cached_plot(out / next(names), records),
        _load_plot(out / next(names), records),
        _admission_plot(out / next(names), records),
    ]


def plot_compare(out_dir: str | Path, runs: Mapping[str, Sequence[RequestRecord]]) -> list[Path]:
    """Overlaid TTFT and TBT CDFs of labelled runs: ``compare_ttft_cdf.png``, ``compare_tbt_cdf.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        _cdf_plot(out / "compare_ttft_cdf.png", {k: _ttfts(v) for k, v in runs.items()}, "TTFT (s)", "TTFT CDF"),
        _cdf_plot(out / "compare_tbt_cdf.png", {k: _tbts(v) for k, v in runs.items()}, "TBT (s)", "TBT CDF"),
    ]
