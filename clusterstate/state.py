"""``ClusterState``: the registry and the block index of one Conductor, behind one lock.

Every change is a transition here (``register``, ``heartbeat``, ``apply``, ``remove``,
``reap_expired``), applied in the order of the cluster's log (``clusterstate.log``), so every
replica that applied the same entries holds the same state (``digest`` compares them).
Rules shared by every caller:

- A worker holds a block at one tier at a time; a ``STORED`` event sets (or moves) it, a
  ``REMOVED`` event drops it. Events of a worker that is not alive are ignored: its blocks
  would never be offered, and ignoring them keeps a dead worker from leaking index entries.
- A worker is alive from ``register`` until ``remove`` or until ``ttl_s`` passes without a
  ``heartbeat`` (time in which no Conductor ran does not count: ``renew_leases``). An
  expired worker vanishes from ``workers()`` and ``match()`` at once; its blocks are purged
  by ``reap_expired()`` or when the id registers again. A registration as a new instance
  (another ``instance_id``) drops what the old one held.
- ``match(keys)`` reports, per alive worker, the contiguous held prefix of ``keys`` and the
  usable prefix under the hybrid hit rule (``kvstore.hitrule``).

Thread-safe: one lock; every method takes it once and calls only the registry, the index
and value code under it (no I/O).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from clusterstate.registry import Clock, WorkerEntry, WorkerRegistry
from clusterstate.workers import WorkerInfo, WorkerLoad
from kvstore.block_index import BlockHold, BlockIndex
from kvstore.blocks import BlockKey
from kvstore.index import BlockEvent, MatchSnapshot, check_keys

if TYPE_CHECKING:
    from kvstore.placement import StoreEvent


class ClusterState:
    """``ttl_s``: the heartbeat lease; ``clock``: the cluster's wall clock (seconds), which
    changes are stamped with and leases run on, unless ``hold_leases`` (set by the log that
    feeds this state) names a time to judge them at instead: a replica cut off from the log
    hears no heartbeats and must not take that for every worker's death. ``reap_after_s``: how
    long an expired worker's record and blocks are kept (hidden) before they are purged, so
    that heartbeats another replica took meanwhile, arriving late through the log, still find
    it (each is judged at its own time)."""

    def __init__(self, ttl_s: float = 10.0, clock: Clock = time.time, reap_after_s: float = 0.0) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.reap_after_s = reap_after_s
        self.hold_leases: Callable[[], float | None] = lambda: None
        self._registry = WorkerRegistry(ttl_s, self._lease_now)
        self._blocks = BlockIndex()

    def _lease_now(self) -> float:
        held = self.hold_leases()
        return self._clock() if held is None else held

    @property
    def ttl_s(self) -> float:
        return self._registry.ttl_s

    def now(self) -> float:
        """The cluster's wall clock (what changes are stamped with)."""
        return self._clock()

    # ---- transitions --------------------------------------------------------------------------
    def register(self, info: WorkerInfo, at_s: float | None = None) -> bool:
        """Register or refresh a worker (counts as a heartbeat). True for a new incarnation:
        its old blocks are dropped and its load starts at ``WorkerLoad.initial``."""
        with self._lock:
            self._reap()
            is_new = self._registry.register(info, at_s)
            if is_new:
                self._blocks.drop_worker(info.worker_id)
            return is_new

    def heartbeat(self, worker_id: str, load: WorkerLoad, events: Sequence[BlockEvent] = (),
                  at_s: float | None = None, seq: int = 0) -> bool:
        """Record ``load``, renew the lease and apply the worker's block ``events``; False
        (nothing applied) when the worker is not alive: it must register again."""
        with self._lock:
            if not self._registry.heartbeat(worker_id, load, at_s, seq):
                return False
            for event in events:
                self._blocks.apply(event)
            return True

    def apply(self, events: Sequence[BlockEvent], at_s: float | None = None) -> int:
        """Apply events in order (that happened at ``at_s``, default now); return how many were
        applied (events of workers that were not alive then are not)."""
        with self._lock:
            self._reap()
            alive: dict[str, bool] = {}
            num_applied = 0
            for event in events:
                w = event.worker_id
                if alive.setdefault(w, self._registry.is_alive(w, at_s)):
                    self._blocks.apply(event)
                    num_applied += 1
            return num_applied

    def apply_store_events(self, worker_id: str, events: Sequence[StoreEvent], at_s: float | None = None) -> int:
        """One worker's store changes, in order (``kvstore.placement.StoreEvent``: "stored" and
        "moved" set its holding, "removed" drops it), applied exactly as ``apply`` applies the
        ``BlockEvent`` of each, without making one per block (the simulator's prefill workers
        publish this way); how many were applied (none when the worker was not alive then)."""
        with self._lock:
            self._reap()
            if not events or not self._registry.is_alive(worker_id, at_s):
                return 0
            check_keys([e.key for e in events])
            self._blocks.apply_store_events(worker_id, events)
            return len(events)

    def renew_leases(self, quiet_since_s: float, at_s: float | None = None) -> list[str]:
        """The log was quiet from ``quiet_since_s`` to ``at_s`` (no Conductor was taking
        heartbeats): every worker alive at ``quiet_since_s`` has its lease renewed from
        ``at_s``, so that it is judged by its heartbeats from then on. Their ids."""
        with self._lock:
            return self._registry.renew(quiet_since_s, self._clock() if at_s is None else at_s)

    def remove(self, worker_id: str) -> bool:
        """Forget a worker and all its blocks; return whether it was known."""
        with self._lock:
            self._blocks.drop_worker(worker_id)
            return self._registry.remove(worker_id)

    def reap_expired(self) -> tuple[str, ...]:
        """Purge workers whose lease ran out (``reap_after_s`` ago), with their blocks; their ids."""
        with self._lock:
            return self._reap()

    def alive_ids(self) -> list[str]:
        with self._lock:
            return self._registry.alive_ids()

    def _reap(self) -> tuple[str, ...]:
        expired = self._registry.reap_expired(self.reap_after_s)
        for worker_id in expired:
            self._blocks.drop_worker(worker_id)
        return tuple(expired)

    # ---- reading ------------------------------------------------------------------------------
    def match(self, keys: Sequence[BlockKey]) -> MatchSnapshot:
        """Prefix match of ``keys`` against every alive worker (sorted by id, zero matches
        included). No side effects."""
        with self._lock:
            return self._blocks.match(keys, self._registry.alive_ids())

    def workers(self) -> list[tuple[WorkerInfo, WorkerLoad]]:
        """Alive workers with their latest load, sorted by worker id."""
        with self._lock:
            return self._registry.workers()

    def worker(self, worker_id: str) -> WorkerInfo | None:
        """The alive worker's registration, else None."""
        with self._lock:
            entry = self._registry.entry(worker_id)
            return entry.info if entry is not None else None

    def stored_events(self) -> list[BlockEvent]:
        """One ``STORED`` event per block of every alive worker, to replay into another state."""
        with self._lock:
            return [BlockEvent.stored(w, key, hold.tier, hold.has_snapshot)
                    for w in self._registry.alive_ids() for key, hold in sorted(self._blocks.holdings(w).items())]

    # ---- whole-state copies (the log's snapshots) ---------------------------------------------
    def export(self) -> list[tuple[WorkerEntry, dict[BlockKey, BlockHold]]]:
        """Every registry entry with the blocks it holds, by worker id."""
        with self._lock:
            return [(e, self._blocks.holdings(e.info.worker_id)) for e in self._registry.entries()]

    def replace(self, workers: Sequence[tuple[WorkerEntry, dict[BlockKey, BlockHold]]]) -> None:
        """Become exactly ``workers`` (an ``export``, of this state or another replica's)."""
        with self._lock:
            for worker_id in self._registry.known_ids():
                self._blocks.drop_worker(worker_id)
                self._registry.remove(worker_id)
            for entry, held in workers:
                self._registry.restore(entry)
                for key, hold in held.items():
                    self._blocks.apply(BlockEvent.stored(entry.info.worker_id, key, hold.tier, hold.has_snapshot))

    def digest(self) -> str:
        """A hash of every registration, lease and holding: equal on two replicas exactly when
        they hold the same state."""
        h = hashlib.blake2b(digest_size=16)
        for entry, held in self.export():
            h.update(repr((entry.info, entry.load, entry.last_seen_s, entry.heartbeat_seq)).encode())
            for key in sorted(held):
                h.update(key + bytes((held[key].code,)))
        return h.hexdigest()

    def blocks_digest(self) -> tuple[str, int]:
        """A hash of every worker's holdings alone, and how many holdings there are."""
        h, n = hashlib.blake2b(digest_size=16), 0
        for entry, held in self.export():
            h.update(entry.info.worker_id.encode() + b"\0")
            for key in sorted(held):
                h.update(key + bytes((held[key].code,)))
            n += len(held)
        return h.hexdigest(), n

    def check_integrity(self) -> None:
        with self._lock:
            self._registry.check_integrity()
            self._blocks.check_integrity(self._registry.known_ids())
