"""A one-line progress bar with counts, for long commands (no dependency).

On a terminal the line is redrawn in place (``\\r``); elsewhere (logs, pipes) only the
finished line of each phase is written, so logs stay short. Not thread-safe.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 24


class CalibrationProgress:
    """``with CalibrationProgress("prefill", 27) as bar: ... bar.advance()``."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None):
        self.label, self.total, self.done = label, max(total, 1), 0
        self.stream = stream if stream is not None else sys.stderr
        self._live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = time.perf_counter()

    def __enter__(self) -> CalibrationProgress:
        if self._live:
            self._draw("\r")
        return self

    def __exit__(self, *exc: object) -> None:
        self._draw("\r" if self._live else "")
        self.stream.write("\n")
        self.stream.flush()

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if self._live:
            self._draw("\r")

    def _draw(self, prefix: str) -> None:
        filled = _WIDTH * self.done // self.total
        bar = "#" * filled + "-" * (_WIDTH - filled)
        elapsed = time.perf_counter() - self._start
        self.stream.write(f"{prefix}{self.label:<9}[{bar}] {self.done}/{self.total}  {elapsed:5.1f} s")
        self.stream.flush()
