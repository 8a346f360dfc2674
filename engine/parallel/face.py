"""What rank 0 of every parallel instance does the same way, whatever splits the model: send
one op at a time, keep the other ranks from timing out while idle, remember which requests the
other ranks hold, and fail once.

Owns ``Face``, the base of ``engine.parallel.leader.GroupModel`` (tensor and expert
parallelism) and ``engine.parallel.pipeline_leader.PipelineModel`` (pipeline stages):

- ``_send``: the cache drops that finalizers queued (from any thread), then the op's header and
  int vector (``engine.parallel.ops``); under ``_lock``, which every op holds from its ``_send``
  to its last collective.
- keepalive: the other ranks wait for the next op in a collective, which fails after the
  group's timeout; a daemon thread sends ``NOOP`` when no op has gone out for a quarter of it.
- ``_is_current`` / ``_mark_current``: requests (by object) whose cache every rank holds
  because the group computed it; any other request with tokens is synced before its first op.
- ``_fail``: the first failed collective records the reason and calls ``on_failure`` once.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from engine.cache import SequenceCache
from engine.parallel.comm import GroupFailed
from engine.parallel.group import Channel
from engine.parallel.ops import Op, header

log = logging.getLogger(__name__)


class Face:
    def __init__(self, channel: Channel, on_failure: Callable[[str], None] | None, keepalive_s: float):
        assert channel.is_leader
        self.channel, self.on_failure = channel, on_failure
        self._lock = threading.RLock()
        self._next_cache_id = 1
        self._dropped: collections.deque[int] = collections.deque()  # appended by finalizers, any thread
        self._current: dict[int, weakref.ref] = {}  # id(seq) -> the seq whose cache every rank holds
        self._last_op_s = time.monotonic()
        self.failed = ""
        if keepalive_s > 0:
            threading.Thread(target=self._keepalive, args=(keepalive_s,), name="rank-keepalive", daemon=True).start()

    def _new_cache_id(self) -> int:
        cache_id, self._next_cache_id = self._next_cache_id, self._next_cache_id + 1
        return cache_id

    def _send(self, op: Op, *args: int, ints: Sequence[int] = ()) -> None:
        """Sends the pending cache drops, then this op's header and ints. Under the lock."""
        if self.failed:
            raise GroupFailed(f"this instance lost a rank earlier: {self.failed}")
        try:
            while self._dropped:
                h = header(Op.DROP_CACHE, self._dropped.popleft())
                self.channel.ints(h, len(h))
            h = header(op, *args)
            self.channel.ints(h, len(h))
            self.channel.ints(list(ints), len(ints))
            self._last_op_s = time.monotonic()
        except GroupFailed as e:
            self._fail(e)
            raise

    def _fail(self, e: GroupFailed) -> None:
        if not self.failed:
            self.failed = str(e)
            log.error("the instance lost a rank: %s", e)
            if self.on_failure is not None:
                self.on_failure(str(e))

    def _keepalive(self, interval_s: float) -> None:
        while not self.failed:
            time.sleep(interval_s / 4)
            if time.monotonic() - self._last_op_s < interval_s or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self.failed:
                    self._send(Op.NOOP)
            except GroupFailed:
                return
            finally:
                self._lock.release()

    def close(self) -> None:
        """Tells every rank to stop (best effort: a lost rank cannot be told)."""
        with self._lock:
            if self.failed:
                return
            try:
                self._send(Op.SHUTDOWN)
            except GroupFailed:
                return
            self.failed = "closed"

    def _is_current(self, seq: SequenceCache) -> bool:
        ref = self._current.get(id(seq))
        return ref is not None and ref() is seq

    def _mark_current(self, seq: SequenceCache) -> None:
        key = id(seq)
        self._current[key] = weakref.ref(seq, lambda _, key=key: self._current.pop(key, None))
