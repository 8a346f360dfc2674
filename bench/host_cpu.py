"""The host's CPU time while a benchmark runs, sampled from ``/proc/stat``: how much of it was
busy, and how much the hypervisor gave to other guests (``steal``), which a virtual machine
shared with others loses without any process of its own running slower in its own eyes.

``HostCPU`` samples the cumulative counters in a thread (``with HostCPU() as cpu: ...``);
``shares(samples, t0_s, t1_s)`` is the busy and steal share of the CPU time between two moments
of the sampler's clock (seconds since it started). Linux only: elsewhere there are no samples.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

STAT = Path("/proc/stat")
INTERVAL_S = 0.5


def read_counters() -> tuple[int, int, int] | None:
    """(busy, steal, total) jiffies of all CPUs since boot; None where ``/proc/stat`` is absent.
    Busy is user + nice + system + irq + softirq; total adds idle, iowait and steal."""
    try:
        fields = [int(x) for x in STAT.read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq
    return busy, steal, busy + idle + iowait + steal


class HostCPU:
    """Samples ``read_counters`` every ``interval_s`` until closed; ``samples`` holds
    (seconds since start, busy, steal, total)."""

    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-cpu", daemon=True)
        self._t0 = 0.0

    def __enter__(self) -> HostCPU:
        self._t0 = time.perf_counter()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        c = read_counters()
        if c is not None:
            self.samples.append((time.perf_counter() - self._t0, *c))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()


def shares(samples: list[tuple[float, int, int, int]], t0_s: float, t1_s: float) -> dict | None:
    """Busy and steal shares of the CPU time from the last sample at or before ``t0_s`` (or the
    first) to the first at or after ``t1_s`` (or the last); None without two samples between."""
    if len(samples) < 2:
        return None
    a = max((s for s in samples if s[0] <= t0_s), key=lambda s: s[0], default=samples[0])
    b = min((s for s in samples if s[0] >= t1_s), key=lambda s: s[0], default=samples[-1])
    total = b[3] - a[3]
    if total <= 0:
        return None
    return {"from_s": round(a[0], 1), "to_s": round(b[0], 1), "busy_share": round((b[1] - a[1]) / total, 3),
            "steal_share": round((b[2] - a[2]) / total, 3)}
