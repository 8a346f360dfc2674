"""The simulator's clock and event queue: callbacks ordered by (time, insertion order)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from conductor.clock import ManualClock


class EventLoop:
    def __init__(self, clock: ManualClock | None = None):
        self.clock = clock or ManualClock()
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self.num_events = 0

    @property
    def now(self) -> float:
        return self.clock.now()

    def at(self, t_s: float, fn: Callable[..., None], *args) -> None:
        """Run ``fn(*args)`` at time ``t_s`` (never before now)."""
        heapq.heappush(self._heap, (max(t_s, self.now), next(self._seq), fn, args))

    def run(self, until_s: float = float("inf"), keep_going: Callable[[], bool] = lambda: True) -> None:
        """Process events in order until none is left (or ``until_s``, or ``keep_going()`` is False)."""
        while self._heap and keep_going():
            t_s, _, fn, args = self._heap[0]
            if t_s > until_s:
                return
            heapq.heappop(self._heap)
            self.clock.advance(t_s - self.now)
            self.num_events += 1
            fn(*args)
