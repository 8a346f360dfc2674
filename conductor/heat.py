"""Prefix heat: how often each prompt's leading block has been asked for lately.

A decayed count per key: every access adds 1 and the count decays as ``exp(-dt / window_s)``,
so ``rate = count / window_s`` approximates accesses per second over the last window. The
hot-prefix rule of ``mooncake`` reads it through the snapshot. Keeps at most ``max_keys``
keys: when one more arrives, the coldest tenth go at once (one sort for ``max_keys / 10``
arrivals, not a scan at each), coldest by ``log(count) + at_s / window_s``, which orders keys
as their decayed counts do at any time. Thread-safe; time is given by the caller.
"""

from __future__ import annotations

import math
import threading


class PrefixHeat:
    def __init__(self, window_s: float = 10.0, max_keys: int = 10_000):
        if window_s <= 0 or max_keys < 1:
            raise ValueError(f"window_s {window_s} must be > 0 and max_keys {max_keys} >= 1")
        self.window_s, self.max_keys = window_s, max_keys
        self._counts: dict[bytes, tuple[float, float]] = {}  # key -> (count, at_s)
        self._lock = threading.Lock()

    def _decayed(self, key: bytes, now_s: float) -> float:
        count, at_s = self._counts.get(key, (0.0, now_s))
        return count * math.exp(-max(0.0, now_s - at_s) / self.window_s)

    def touch(self, key: bytes, now_s: float) -> float:
        """Count one access of ``key``; return its rate (per second) including this one."""
        with self._lock:
            count = self._decayed(key, now_s) + 1.0
            self._counts[key] = (count, now_s)
            if len(self._counts) > self.max_keys:
                self._forget_coldest()
            return count / self.window_s

    def _forget_coldest(self) -> None:
        window_s = self.window_s
        by_heat = sorted(self._counts, key=lambda k: math.log(self._counts[k][0]) + self._counts[k][1] / window_s)
        for key in by_heat[: max(1, len(by_heat) - self.max_keys * 9 // 10)]:
            del self._counts[key]

    def rate(self, key: bytes, now_s: float) -> float:
        with self._lock:
            return self._decayed(key, now_s) / self.window_s
