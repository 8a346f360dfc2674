"""Streamed token ids -> text: incremental detokenization (``engine.detokenizer.Detokenizer``,
re-exported here) and stop-string matching.

``StopMatcher`` finds stop strings in that text across token boundaries. It emits only text
that cannot be the start of a stop string: the longest tail of the text seen so far that is a
prefix of some stop string is held back until the next delta decides it. A stop string that
matches ends the text exactly before it (the stop string itself is never emitted).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.detokenizer import INCOMPLETE, Detokenizer

__all__ = ["INCOMPLETE", "Detokenizer", "StopMatcher"]


class StopMatcher:
    """Not thread-safe: one per request. Empty stop strings are the caller's error."""

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string matched). After a match, nothing more is fed."""
        if not self.stops:
            return text, False
        full = self._pending + text
        hits = [i for i in (full.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            return full[:min(hits)], True
        hold = self._holdback_len(full)
        self._pending = full[len(full) - hold:]
        return full[:len(full) - hold], False

    def flush(self) -> str:
        """The held-back text at the end of the stream: it never completed a stop string."""
        out, self._pending = self._pending, ""
        return out

    def _holdback_len(self, full: str) -> int:
        """Length of the longest tail of ``full`` that is a proper prefix of some stop string."""
        longest = min(len(full), max(len(s) for s in self.stops) - 1)
        for k in range(longest, 0, -1):
            tail = full[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
