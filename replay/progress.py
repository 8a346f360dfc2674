"""Progress lines on stderr for the long commands over a trace: the live replay's
(``ReplayProgress``: done/total, outcomes, in flight, waiting for a free sender, p50 TTFT so
far) and the simulator's (``SimProgress``: a record sink that passes every record on and
counts it: done/total, outcomes, the simulated time reached, the wall time and what is left).

On a terminal the line is rewritten in place (carriage return) at most ``refresh_s`` apart; to
a file or pipe it is written as a new line at most every ``log_every_s`` (``StatusLine``).
``ReplayProgress`` is thread-safe: the replay's threads call ``submitted``/``started``/``done``
concurrently (one lock). ``SimProgress`` runs on the simulation's one thread.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TextIO

from replay.records import CANCELLED, FAILED, FINISHED, REJECTED, RequestRecord
from replay.summary import Summary


class StatusLine:
    """One status line on ``stream`` (None: nowhere): ``show(make_line)`` renders it when its
    interval has passed (``make_line`` is called only then), ``close`` renders it a last time."""

    def __init__(self, stream: TextIO | None, refresh_s: float, log_every_s: float):
        self._stream = stream
        self._tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self._every_s = refresh_s if self._tty else log_every_s
        self._last = float("-inf")

    def show(self, make_line: Callable[[], str], force: bool = False) -> None:
        now = time.monotonic()
        if self._stream is None or (not force and now - self._last < self._every_s):
            return
        self._last = now
        self._stream.write(("\r\x1b[K" + make_line()) if self._tty else (make_line() + "\n"))
        self._stream.flush()

    def close(self, make_line: Callable[[], str]) -> None:
        """The line a last time, then ``end``."""
        self.show(make_line, force=True)
        self.end()

    def end(self) -> None:
        """Ends a line rewritten in place (on a terminal) so that what follows starts below it."""
        if self._tty and self._stream is not None and self._last != float("-inf"):
            self._stream.write("\n")
            self._stream.flush()


class ReplayProgress:
    def __init__(self, total: int, stream: TextIO | None, *, refresh_s: float = 0.1, log_every_s: float = 5.0):
        self.total = total
        self._status = StatusLine(stream, refresh_s, log_every_s)
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
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

    def _maybe_render(self) -> None:
        self._status.show(self.line)

    def close(self) -> None:
        with self._lock:
            self._status.close(self.line)


class SimProgress:
    """A record sink (``replay.sim.sinks.RecordSink``) that counts each record, shows the
    simulator's status line, and passes the record on to ``sink``; ``finish`` ends the line."""

    def __init__(self, sink: Any, total: int, stream: TextIO | None, *, refresh_s: float = 0.5,
                 log_every_s: float = 10.0):
        self.sink, self.total = sink, total
        self.in_index_order = sink.in_index_order
        self._status = StatusLine(stream, refresh_s, log_every_s)
        self._outcomes: Counter[str] = Counter()
        self._num_done = 0
        self._simulated_s = 0.0  # the latest arrival among the ended requests
        self._t0 = time.monotonic()

    def add(self, record: RequestRecord) -> None:
        self._outcomes[record.outcome] += 1
        self._num_done += 1
        if record.arrival_s > self._simulated_s:
            self._simulated_s = record.arrival_s
        self.sink.add(record)
        self._status.show(self.line)

    def line(self) -> str:
        o, done = self._outcomes, self._num_done
        wall_s = time.monotonic() - self._t0
        # what is left, at the pace so far: once a hundredth is done (the first records come fast)
        left = ""
        if self.total > done >= self.total / 100:
            left = f", about {wall_s * (self.total - done) / done:.0f}s left"
        return (f"simulate: done {done}/{self.total} ({100 * done / max(1, self.total):.1f}%: finished {o[FINISHED]}, "
                f"rejected {o[REJECTED]}), arrivals up to {self._simulated_s:.1f}s simulated, {wall_s:.1f}s{left}")

    def finish(self, *, trace: dict[str, Any], run: dict[str, Any]) -> Summary:
        self._status.close(self.line)
        return self.sink.finish(trace=trace, run=run)
