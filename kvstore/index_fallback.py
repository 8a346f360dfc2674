"""``FallbackIndex``: the Redis index with a local mirror that answers while Redis is down."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstore.blocks import BlockKey
from kvstore.index import BlockEvent, GlobalIndex, IndexUnavailable, MatchSnapshot, WorkerInfo, WorkerLoad
from kvstore.index_memory import MemoryIndex
from kvstore.index_redis import RedisIndex
from kvstore.registry import Clock

logger = logging.getLogger(__name__)
T = TypeVar("T")


class FallbackIndex(GlobalIndex):
    """Redis when reachable, else the local ``MemoryIndex`` that mirrors every write.

    Every event, registration and heartbeat goes to ``local`` first, so local always knows
    what this Conductor has been told. When Redis fails, one warning is logged per outage and
    reads answer from local. After ``retry_interval_s`` (on ``clock``) a call tries to
    resync: it re-registers local's alive workers with their latest load and re-publishes
    their blocks, then switches back to Redis. The resync is additive: a removal seen only
    during the outage stays in Redis until that worker's next event for the block, its
    removal or its expiry (a stale holder makes a transfer fail loudly, never serve bad data).

    Locking: ``_lock`` orders local writes against the resync, so no write is lost between
    the resync's copy of local and the switch back. Writers wait for a running resync; reads
    never wait for it (they answer from local meanwhile).
    """

    def __init__(
        self,
        primary: RedisIndex,
        local: MemoryIndex,
        retry_interval_s: float = 1.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.primary = primary
        self.local = local
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._is_up = True
        self._next_retry_s = 0.0

    @property
    def using_primary(self) -> bool:
        return self._is_up

    def apply(self, events: Sequence[BlockEvent]) -> int:
        with self._lock:
            num_applied = self.local.apply(events)
            use_primary = self._ready_locked()
        if use_primary:
            self._on_primary(lambda p: p.apply(events))
        return num_applied

    def register(self, worker: WorkerInfo) -> bool:
        with self._lock:
            is_new = self.local.register(worker)
            use_primary = self._ready_locked()
        if use_primary:
            self._on_primary(lambda p: p.register(worker))
        return is_new

    def heartbeat(self, worker_id: str, load: WorkerLoad) -> bool:
        with self._lock:
            is_alive = self.local.heartbeat(worker_id, load)
            use_primary = self._ready_locked()
        if use_primary:
            result = self._on_primary(lambda p: p.heartbeat(worker_id, load))
            return is_alive if result is None else result
        return is_alive

    def remove(self, worker_id: str) -> bool:
        with self._lock:
            was_known = self.local.remove(worker_id)
            use_primary = self._ready_locked()
        if use_primary:
            self._on_primary(lambda p: p.remove(worker_id))
        return was_known

    def match(self, keys: Sequence[BlockKey]) -> MatchSnapshot:
        result = self._read(lambda p: p.match(keys))
        return self.local.match(keys) if result is None else result

    def workers(self) -> list[tuple[WorkerInfo, WorkerLoad]]:
        result = self._read(lambda p: p.workers())
        return self.local.workers() if result is None else result

    def reap_expired(self) -> tuple[str, ...]:
        reaped = set(self.local.reap_expired())
        reaped.update(self._read(lambda p: p.reap_expired()) or ())
        return tuple(sorted(reaped))

    def close(self) -> None:
        self.primary.close()
        self.local.close()

    def _read(self, op: Callable[[RedisIndex], T]) -> T | None:
        """``op`` on Redis when usable (trying a due resync unless one runs), else None."""
        if not self._is_up and self._lock.acquire(blocking=False):
            try:
                self._ready_locked()
            finally:
                self._lock.release()
        return self._on_primary(op) if self._is_up else None

    def _on_primary(self, op: Callable[[RedisIndex], T]) -> T | None:
        try:
            return op(self.primary)
        except IndexUnavailable as exc:
            with self._lock:
                self._mark_down_locked(exc)
            return None

    def _ready_locked(self) -> bool:
        """Whether to use Redis now; when down and a retry is due, resync first."""
        if self._is_up:
            return True
        if self._clock() < self._next_retry_s:
            return False
        try:
            self._resync_locked()
        except IndexUnavailable as exc:
            self._next_retry_s = self._clock() + self.retry_interval_s
            logger.debug("global index still unavailable: %s", exc)
            return False
        self._is_up = True
        logger.info("global index at %s is reachable again; resynced from local state", self.primary.url)
        return True

    def _resync_locked(self) -> None:
        for info, load in self.local.workers():
            self.primary.register(info)
            self.primary.heartbeat(info.worker_id, load)
        self.primary.apply(self.local.stored_events())

    def _mark_down_locked(self, exc: IndexUnavailable) -> None:
        if self._is_up:
            logger.warning(
                "%s; answering from local index, retrying every %.1f s", exc, self.retry_interval_s
            )
        self._is_up = False
        self._next_retry_s = self._clock() + self.retry_interval_s
