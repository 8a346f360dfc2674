"""In-process worker registry: who is alive (leases renewed by heartbeats) and their latest load.

Owned by ``MemoryIndex``, which serialises access with its own lock; this class takes no lock
and must not be shared between threads without one. Time comes from an injected monotonic
``clock`` (seconds) so expiry is testable without sleeping. An expired worker stays in the
table, invisible to readers, until ``reap_expired`` or a new registration of its id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvstore.index import WorkerInfo, WorkerLoad

Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerEntry:
    info: WorkerInfo
    load: WorkerLoad
    last_seen_s: float


class WorkerRegistry:
    """Leases of ``ttl_s`` seconds: a worker is alive while ``clock() - last_seen_s < ttl_s``."""

    def __init__(self, ttl_s: float, clock: Clock) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, WorkerEntry] = {}

    def is_alive(self, worker_id: str) -> bool:
        entry = self._entries.get(worker_id)
        return entry is not None and self._clock() - entry.last_seen_s < self.ttl_s

    def alive_ids(self) -> list[str]:
        now_s = self._clock()
        return sorted(w for w, e in self._entries.items() if now_s - e.last_seen_s < self.ttl_s)

    def register(self, info: WorkerInfo) -> bool:
        """Add or refresh ``info``; True for a new incarnation (the id was not alive)."""
        is_new = not self.is_alive(info.worker_id)
        load = WorkerLoad.initial(info) if is_new else self._entries[info.worker_id].load
        self._entries[info.worker_id] = WorkerEntry(info, load, self._clock())
        return is_new

    def heartbeat(self, worker_id: str, load: WorkerLoad) -> bool:
        """Record ``load`` and renew the lease; False (no change) when the worker is not alive."""
        if not self.is_alive(worker_id):
            return False
        self._entries[worker_id] = WorkerEntry(self._entries[worker_id].info, load, self._clock())
        return True

    def remove(self, worker_id: str) -> bool:
        return self._entries.pop(worker_id, None) is not None

    def workers(self) -> list[tuple[WorkerInfo, WorkerLoad]]:
        return [(self._entries[w].info, self._entries[w].load) for w in self.alive_ids()]

    def known_ids(self) -> set[str]:
        """Every id in the table, alive or expired-but-not-reaped."""
        return set(self._entries)

    def reap_expired(self) -> list[str]:
        """Drop expired entries; return their ids, sorted."""
        alive = set(self.alive_ids())
        expired = sorted(w for w in self._entries if w not in alive)
        for worker_id in expired:
            del self._entries[worker_id]
        return expired

    def check_integrity(self) -> None:
        now_s = self._clock()
        for worker_id, entry in self._entries.items():
            assert entry.info.worker_id == worker_id, (worker_id, entry)
            assert entry.last_seen_s <= now_s, f"{worker_id} seen at {entry.last_seen_s} > now {now_s}"
