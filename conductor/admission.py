"""Bounded admission: at most ``max_running`` requests in the cluster, ``max_queued`` waiting.

A request beyond both bounds is refused at once (the caller answers RESOURCE_EXHAUSTED); a
queued one waits for a running slot for at most the timeout its caller gives. The Conductor
gives the sooner of the request's deadline (``deadline_s``, or the client's gRPC deadline)
and ``--max-queue-wait-s``, and answers DEADLINE_EXCEEDED when the deadline was the bound,
RESOURCE_EXHAUSTED when the cap was. Thread-safe (one condition variable).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionConfig:
    max_running: int = 16
    max_queued: int = 64

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_queued < 0:
            raise ValueError(f"max_running {self.max_running} must be >= 1 and max_queued {self.max_queued} >= 0")


class Admission:
    def __init__(self, config: AdmissionConfig):
        self.config = config
        self._cond = threading.Condition()
        self.num_running = 0
        self.num_queued = 0

    def try_enter(self, timeout_s: float) -> str | None:
        """None when admitted (the caller must ``leave`` later); else the refusal reason."""
        cfg = self.config
        with self._cond:
            if self.num_running >= cfg.max_running and self.num_queued >= cfg.max_queued:
                return (f"admission queue full: {self.num_running} running (limit {cfg.max_running}), "
                        f"{self.num_queued} queued (limit {cfg.max_queued})")
            self.num_queued += 1
            until = time.monotonic() + timeout_s
            try:
                while self.num_running >= cfg.max_running:
                    left = until - time.monotonic()
                    if left <= 0:
                        return f"waited {timeout_s:.1f}s in the admission queue without a free slot"
                    self._cond.wait(left)
            finally:
                self.num_queued -= 1
            self.num_running += 1
            return None

    def leave(self) -> None:
        with self._cond:
            assert self.num_running > 0, "leave without enter"
            self.num_running -= 1
            self._cond.notify()
