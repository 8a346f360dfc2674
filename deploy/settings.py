"""The one place that reads environment variables (all prefixed ``TIDEKV_``)."""

from __future__ import annotations

import os

import torch


def torch_threads() -> int:
    """Threads each process gives torch: TIDEKV_TORCH_THREADS, default 1 (servers share 2 cores)."""
    return int(os.environ.get("TIDEKV_TORCH_THREADS", "1"))


def setup_torch(threads: int | None = None) -> None:
    torch.set_num_threads(threads or torch_threads())
    torch.set_flush_denormal(True)
