"""The live replay's progress line on stderr: done/total, outcomes, in flight, waiting for a free
sender, p50 TTFT so far.

On a terminal the line is rewritten in place (carriage return) at most ``refresh_s`` apart; to
a file or pipe it is written as a new line at most every ``log_every_s``. Thread-safe: the
replay's threads call ``submitted``/``started``/``done`` concurrently (one lock).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from typing import TextIO

from replay.records import CANCELLED, FAILED, FINISHED, REJECTED, RequestRecord


class ReplayProgress:
    def __init__(self, total: int, stream: TextIO | None, *, refresh_s: float = 0.1, log_every_s: float = 5.0):
        self.total = total
        self._stream = stream
        self._tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self._every_s = refresh_s if self._tty else log_every_s
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._last = float("-inf")
        self._num_submitted = 0  # handed to the sender pool at the arrival time
        self._num_started = 0  # actually sent
        self._outcomes: Counter[str] = Counter()
        self._ttfts: list[float] = []  # sorted

    def submitted(self) -> None:
        with self._lock:
            self._num_submitted += 1

    def started(self) -> None:
        with self._lock:
            self._num_started += 1
            self._maybe_render()

    def done(self, record: RequestRecord) -> None:
        with self._lock:
            self._outcomes[record.outcome] += 1
            if record.outcome == FINISHED and record.ttft_s is not None:
                bisect.insort(self._ttfts, record.ttft_s)
            self._maybe_render()

    def line(self) -> str:
        o = self._outcomes
        num_done = sum(o.values())
        p50 = f"{self._ttfts[(len(self._ttfts) - 1) // 2]:.3f}s" if self._ttfts else "-"
        return (f"replay: done {num_done}/{self.total} (finished {o[FINISHED]}, rejected {o[REJECTED]}, "
                f"failed {o[FAILED]}, cancelled {o[CANCELLED]}), in flight {self._num_started - num_done}, "
                f"waiting {self._num_submitted - self._num_started}, "
                f"p50 TTFT {p50}, {time.monotonic() - self._t0:.1f}s")

    def _maybe_render(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._stream is None or (not force and now - self._last < self._every_s):
            return
        self._last = now
        if self._tty:
            self._stream.write("\r\x1b[K" + self.line())
        else:
            self._stream.write(self.line() + "\n")
        self._stream.flush()

    def close(self) -> None:
        with self._lock:
            self._maybe_render(force=True)
            if self._tty and self._stream is not None:
                self._stream.write("\n")
                self._stream.flush()
