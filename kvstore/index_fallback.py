"""``FallbackIndex``: the Redis index with a local mirror that answers while Redis is down.

Owns the switch between the two and the resync of the local view into Redis. States:

    UP ──call raises IndexUnavailable, or server_epoch moved (Redis lost its state)──► DOWN
    DOWN ──recovery thread: ping answers──► RESYNCING ──local view copied, backlog empty──► UP
                                                 └── a resync call fails, or Redis lost its
                                                     state again meanwhile ──► DOWN (retry later)

In UP, reads go to Redis (the view shared by every Conductor on the namespace) and writes go
to local and then Redis. In DOWN and RESYNCING every call answers from local at once, and no
request waits on Redis: only the calls already under way when it fails wait, each for at most
``RedisIndexConfig.retry_budget_s`` plus one socket timeout (``kvstore.index_redis``).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstore.blocks import BlockKey
from kvstore.index import BlockEvent, GlobalIndex, IndexUnavailable, MatchSnapshot, WorkerInfo, WorkerLoad
from kvstore.index_memory import MemoryIndex
from kvstore.index_redis import RedisIndex

logger = logging.getLogger(__name__)
T = TypeVar("T")
PrimaryOp = Callable[[RedisIndex], object]
JOIN_TIMEOUT_S = 5.0


class Mode(enum.Enum):
    UP = "up"
    DOWN = "down"
    RESYNCING = "resyncing"


@dataclasses.dataclass(frozen=True, slots=True)
class _Period:
    """One stretch of UP: a failure seen by a call of an earlier period changes nothing, and
    ``server_epoch`` is the Redis server generation the local view was last copied into."""

    number: int
    server_epoch: int


@dataclasses.dataclass(frozen=True, slots=True)
class ResyncCounts:
    """What one resync copied into Redis: workers (with their loads), blocks, and the writes
    that arrived while it ran and were replayed after it."""

    num_workers: int
    num_blocks: int
    num_replayed: int


class FallbackIndex(GlobalIndex):
    """Redis when usable, else the local ``MemoryIndex`` that mirrors every write.

    Every event, registration, heartbeat and removal goes to ``local`` first, so local always
    knows what this Conductor has been told. An outage is a call raising ``IndexUnavailable``
    or ``primary.server_epoch`` moving (Redis restarted or was flushed and forgot the index,
    even if no call failed); it is logged once at WARNING. Then a recovery thread (started at
    the first outage; ``recover_in_background=False`` leaves ``try_resync`` to the caller)
    pings Redis every ``retry_interval_s``. Once it answers, the resync makes each of local's
    alive workers alive in Redis with its latest load and exactly the blocks local knows
    (``RedisIndex.reset_worker``, then the blocks), replays the writes that arrived meanwhile,
    switches back and logs the counts at INFO. Workers only this Conductor removed during the
    outage stay in Redis until their lease there ends.

    Locking: ``_lock`` orders local writes against the mode and the backlog, never held over a
    Redis call. A resync copies local under it, then writes Redis without it; writes made
    meanwhile queue in the backlog, which is replayed until empty before the switch, so no
    write is lost or reordered across it. ``_resync_lock`` lets one resync run at a time.
    """

    def __init__(
        self,
        primary: RedisIndex,
        local: MemoryIndex,
        retry_interval_s: float = 1.0,
        recover_in_background: bool = True,
    ) -> None:
        if retry_interval_s <= 0:
            raise ValueError(f"retry_interval_s must be positive, got {retry_interval_s}")
        self.primary = primary
        self.local = local
        self.retry_interval_s = retry_interval_s
        self._recover_in_background = recover_in_background
        self._lock = threading.Lock()
        self._resync_lock = threading.Lock()
        self._mode = Mode.UP
        self._period = _Period(0, primary.server_epoch)
        self._backlog: list[PrimaryOp] = []
        self._down_since_s = 0.0
        self.last_resync: ResyncCounts | None = None
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def using_primary(self) -> bool:
        return self._mode is Mode.UP

    # ---- GlobalIndex ------------------------------------------------------------------------
    def apply(self, events: Sequence[BlockEvent]) -> int:
        events = tuple(events)
        with self._lock:
            num_applied = self.local.apply(events)
            to_primary = self._write_locked(lambda p: p.apply(events))
        if to_primary:
            self._on_primary(lambda p: p.apply(events))
        return num_applied

    def register(self, worker: WorkerInfo) -> bool:
        with self._lock:
            is_new = self.local.register(worker)
            to_primary = self._write_locked(lambda p: p.register(worker))
        if to_primary:
            self._on_primary(lambda p: p.register(worker))
        return is_new

    def heartbeat(self, worker_id: str, load: WorkerLoad) -> bool:
        """False when either view does not know the worker alive: it registers again, which
        heals both (Redis may have expired it a moment before local did, or the reverse)."""
        with self._lock:
            is_alive = self.local.heartbeat(worker_id, load)
            to_primary = self._write_locked(lambda p: p.heartbeat(worker_id, load))
        if to_primary:
            result = self._on_primary(lambda p: p.heartbeat(worker_id, load))
            return is_alive and result is not False
        return is_alive

    def remove(self, worker_id: str) -> bool:
        with self._lock:
            was_known = self.local.remove(worker_id)
            to_primary = self._write_locked(lambda p: p.remove(worker_id))
        if to_primary:
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
        """Stops the recovery thread (waiting out a resync in progress), then both indexes."""
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(JOIN_TIMEOUT_S)
        self.primary.close()
        self.local.close()

    # ---- recovery ---------------------------------------------------------------------------
    def try_resync(self) -> bool:
        """If down and Redis answers, copy local's view into it and switch back; True when
        Redis is in use afterwards. Blocks for Redis round trips (at most one retry budget
        while Redis is still down); callers on a request path must not call it."""
        with self._resync_lock:
            if self._mode is Mode.UP:
                return True
            try:
                self.primary.ping()  # also reloads the scripts, moving server_epoch, after a restart
            except IndexUnavailable as exc:
                logger.debug("global index still unavailable: %s", exc)
                return False
            epoch = self.primary.server_epoch
            with self._lock:
                self._mode, self._backlog = Mode.RESYNCING, []
                workers, events = self.local.workers(), self.local.stored_events()
            try:
                for info, load in workers:
                    self.primary.reset_worker(info, load)
                self.primary.apply(events)
                num_replayed = self._replay_backlog(epoch)
            except IndexUnavailable as exc:
                with self._lock:
                    self._mode, self._backlog = Mode.DOWN, []
                logger.debug("global index failed during the resync: %s", exc)
                return False
            if num_replayed is None:
                logger.debug("global index at %s restarted during the resync; again later", self.primary.url)
                return False
            self.last_resync = counts = ResyncCounts(len(workers), len(events), num_replayed)
        logger.info(
            "global index at %s is reachable again after %.1f s: resynced %d workers and %d blocks "
            "from the local view (%d writes replayed); using Redis again",
            self.primary.url,
            time.monotonic() - self._down_since_s,
            counts.num_workers,
            counts.num_blocks,
            counts.num_replayed,
        )
        return True

    def _replay_backlog(self, epoch: int) -> int | None:
        """Replay queued writes until none is left, then switch to UP; None (and DOWN) when
        Redis lost its state again meanwhile. Raises ``IndexUnavailable`` from a replay."""
        num_replayed = 0
        while True:
            with self._lock:
                ops, self._backlog = self._backlog, []
                if not ops:
                    if self.primary.server_epoch != epoch:
                        self._mode = Mode.DOWN
                        return None
                    self._mode = Mode.UP
                    self._period = _Period(self._period.number + 1, epoch)
                    return num_replayed
            for op in ops:
                op(self.primary)
            num_replayed += len(ops)

    def _recover_loop(self) -> None:
        """The recovery thread: sleeps until an outage, then retries the resync every interval."""
        while True:
            self._wake.wait()
            if self._closed.is_set():
                return
            self._wake.clear()
            while not self.try_resync():
                if self._closed.wait(self.retry_interval_s):
                    return

    # ---- mechanism --------------------------------------------------------------------------
    def _write_locked(self, op: PrimaryOp) -> bool:
        """Whether the write just made to local goes to Redis now; queues it during a resync."""
        if self._mode is Mode.RESYNCING:
            self._backlog.append(op)
        return self._mode is Mode.UP

    def _read(self, op: Callable[[RedisIndex], T]) -> T | None:
        """``op`` on Redis while UP, else None (the caller answers from local)."""
        return self._on_primary(op) if self._mode is Mode.UP else None

    def _on_primary(self, op: Callable[[RedisIndex], T]) -> T | None:
        """``op`` on Redis; None when it failed or Redis turned out to have lost its state."""
        period = self._period
        try:
            result = op(self.primary)
        except IndexUnavailable as exc:
            self._mark_down(period, str(exc))
            return None
        if self.primary.server_epoch != period.server_epoch:
            self._mark_down(period, f"global index at {self.primary.url} lost its state (restarted or flushed)")
            return None
        return result

    def _mark_down(self, period: _Period, reason: str) -> None:
        with self._lock:
            if self._mode is not Mode.UP or self._period is not period:
                return  # an earlier period's call: this outage is already handled
            self._mode = Mode.DOWN
            self._down_since_s = time.monotonic()
            if self._recover_in_background and self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._recover_loop, name="index-recovery", daemon=True)
                self._thread.start()
        logger.warning(
            "%s; answering from this Conductor's local index, retrying every %.1f s", reason, self.retry_interval_s
        )
        self._wake.set()
