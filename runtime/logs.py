"""Log lines that a flood cannot turn into a flood of log lines, and log files only their owner reads.

``Throttled`` logs each kind of event (a key such as "refused:UNAUTHENTICATED") at most
``burst`` times, refilling at ``per_s`` a second (a token bucket per key). The next line
that gets through says how many like it were left out, so nothing is silently lost.
Thread-safe.

``private_log`` opens a log file the way every log file we write is kept: mode 0600 in a
0700 directory (log lines name request ids, tenants and addresses).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from runtime.private import FILE_MODE, private_dir


class Throttled:
    def __init__(self, logger: logging.Logger, per_s: float = 2.0, burst: int = 10,
                 clock: Callable[[], float] = time.monotonic):
        self.logger, self.per_s, self.burst, self._clock = logger, per_s, burst, clock
        self._buckets: dict[str, list[float]] = {}  # key -> [tokens, last refill, suppressed]
        self._lock = threading.Lock()

    def log(self, level: int, key: str, msg: str, *args: object) -> bool:
        """Logs ``msg % args`` unless ``key`` is over its rate; True when it was logged."""
        now = self._clock()
        with self._lock:
            bucket = self._buckets.setdefault(key, [float(self.burst), now, 0])
            bucket[0] = min(float(self.burst), bucket[0] + (now - bucket[1]) * self.per_s)
            bucket[1] = now
            if bucket[0] < 1.0:
                bucket[2] += 1
                return False
            bucket[0] -= 1.0
            suppressed, bucket[2] = int(bucket[2]), 0
        if suppressed:
            msg, args = msg + " (%d more like it not logged)", (*args, suppressed)
        self.logger.log(level, msg, *args)
        return True


def private_log(path: Path, truncate: bool = False) -> TextIO:
    """``path`` opened for appending (``truncate``: emptied first), the file 0600 and its
    directory 0700: made so, or narrowed when they exist. OSError as ``open`` raises it."""
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0), FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return os.fdopen(fd, "a")
