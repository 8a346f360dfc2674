"""Helpers shared by the benchmarks: repeat a timed callable and summarise median and spread."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Runs fn warmup+repeats times; returns median/min/max/p90 seconds of the timed runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return summary(samples)


def summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median_s": statistics.median(s),
        "min_s": s[0],
        "max_s": s[-1],
        "p90_s": s[min(len(s) - 1, int(0.9 * len(s)))],
        "n": len(s),
    }


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``; OSError when it is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
