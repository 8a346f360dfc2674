"""The simulator's clock and event queue: callbacks ordered by (time, insertion order), and a
fed stream of arrivals read one at a time.

``feed(events)`` takes an iterator of ``(t_s, fn, args)`` in time order (the requests'
arrivals) and reads the next one only when the last has run, so a run of any length holds
one pending arrival, not all of them. A fed event runs before every queued event of the
same time: the order the queue would give them had they all been queued first, before any
other event.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from conductor.clock import ManualClock

Event = tuple[float, Callable[..., None], tuple]


class EventLoop:
    def __init__(self, clock: ManualClock | None = None):
        self.clock = clock or ManualClock()
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self._fed: Iterator[Event] = iter(())
        self._next_fed: Event | None = None
        self.num_events = 0

    @property
    def now(self) -> float:
        return self.clock.now()

    def at(self, t_s: float, fn: Callable[..., None], *args) -> None:
        """Run ``fn(*args)`` at time ``t_s`` (never before now)."""
        heapq.heappush(self._heap, (max(t_s, self.now), next(self._seq), fn, args))

    def feed(self, events: Iterator[Event]) -> None:
        """Runs the events of ``events`` (times non-decreasing, none before now) as their times
        come, ahead of queued events of the same time; ValueError when a time goes back."""
        self._fed = events
        self._next_fed = next(events, None)

    def _take_fed(self) -> Event:
        event = self._next_fed
        following = next(self._fed, None)
        if following is not None and following[0] < event[0]:
            raise ValueError(f"fed events must come in time order: {following[0]} s after {event[0]} s")
        self._next_fed = following
        return event

    def run(self, until_s: float = float("inf"), keep_going: Callable[[], bool] = lambda: True) -> None:
        """Process events in order until none is left (or ``until_s``, or ``keep_going()`` is False)."""
        heap, clock = self._heap, self.clock
        while keep_going():
            fed = self._next_fed
            if fed is not None and (not heap or fed[0] <= heap[0][0]):
                if fed[0] > until_s:
                    return
                t_s, fn, args = self._take_fed()
            elif heap:
                t_s, _, fn, args = heap[0]
                if t_s > until_s:
                    return
                heapq.heappop(heap)
            else:
                return
            clock.advance(t_s - clock.now())
            self.num_events += 1
            fn(*args)
