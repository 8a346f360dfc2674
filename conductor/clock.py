"""The Conductor's clocks, injected wherever time is read (the simulator and the tests pass
their own): ``Clock.now()`` is monotonic seconds, ``Clock.wall()`` seconds since the epoch
(what workers stamp their loads with)."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to (tests, the simulator). Not thread-safe."""

    def __init__(self, start_s: float = 0.0, wall_offset_s: float = 1.7e9):
        self.t = start_s
        self._wall_offset_s = wall_offset_s

    def now(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.t + self._wall_offset_s

    def advance(self, dt_s: float) -> None:
        if dt_s < 0:
            raise ValueError(f"a clock cannot go back ({dt_s} s)")
        self.t += dt_s
