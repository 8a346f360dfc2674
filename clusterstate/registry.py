"""The worker registry: each worker's registration, lease and latest load, in one owner.

Time is the cluster's wall clock (seconds since the epoch), injected (``clock``), so every
Conductor replica applying the same log sees the same leases: a change carries the time it
happened (``at_s``, the log entry's) and is judged at that time (was the worker alive
then?), so applying an entry late changes nothing; a reader's question "alive now?" is
``clock() - last_seen_s < ttl_s``. An expired worker stays in the table, invisible to readers, until ``reap_expired``
or a new registration of its id. No lock: the owner (``clusterstate.state.ClusterState``)
serialises access.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from clusterstate.workers import WorkerInfo, WorkerLoad

Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerEntry:
    info: WorkerInfo
    load: WorkerLoad
    last_seen_s: float
    heartbeat_seq: int = 0  # the last heartbeat applied (a worker numbers its heartbeats)


class WorkerRegistry:
    """Leases of ``ttl_s`` seconds, renewed by registrations and heartbeats."""

    def __init__(self, ttl_s: float, clock: Clock) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, WorkerEntry] = {}
        # alive_ids' answer, with the lease it holds under and the last-seen times that bound
        # it: the alive worker seen longest ago and the expired one seen last. Dropped on every
        # change of an entry.
        self._alive: tuple[tuple[str, ...], float, float, float] | None = None

    def _changed(self) -> None:
        self._alive = None

    def now(self) -> float:
        return self._clock()

    def is_alive(self, worker_id: str, at_s: float | None = None) -> bool:
        """Whether the worker is alive now (or at ``at_s``)."""
        entry = self._entries.get(worker_id)
        return entry is not None and (self._clock() if at_s is None else at_s) - entry.last_seen_s < self.ttl_s

    def alive_ids(self) -> list[str]:
        """The alive workers' ids, sorted. Kept while no entry changes and the clock has not
        passed a lease's end (the same test per entry as ever, on the two entries that bound
        the answer: it is monotone in the time and in the last-seen time): a match asks on
        every decision."""
        now_s, ttl_s = self._clock(), self.ttl_s
        kept = self._alive
        if (kept is not None and kept[1] == ttl_s and now_s - kept[2] < ttl_s
                and not now_s - kept[3] < ttl_s):
            return list(kept[0])
        ids, oldest_alive_s, newest_expired_s = [], float("inf"), -float("inf")
        for w, e in self._entries.items():
            if now_s - e.last_seen_s < ttl_s:
                ids.append(w)
                oldest_alive_s = min(oldest_alive_s, e.last_seen_s)
            else:
                newest_expired_s = max(newest_expired_s, e.last_seen_s)
        ids.sort()
        self._alive = (tuple(ids), ttl_s, oldest_alive_s, newest_expired_s)
        return ids

    def entry(self, worker_id: str, at_s: float | None = None) -> WorkerEntry | None:
        """The worker's entry if it is alive now (or at ``at_s``), else None."""
        return self._entries.get(worker_id) if self.is_alive(worker_id, at_s) else None

    def register(self, info: WorkerInfo, at_s: float | None = None) -> bool:
        """Add or refresh ``info``; True for a new incarnation: the id was not alive, or it
        registers as another instance (its old blocks are not held by this one)."""
        at_s = self._clock() if at_s is None else at_s
        old = self.entry(info.worker_id, at_s)
        is_new = old is None or old.info.instance_id != info.instance_id
        self._changed()
        if is_new:
            self._entries[info.worker_id] = WorkerEntry(info, WorkerLoad.initial(info), at_s)
        else:
            self._entries[info.worker_id] = dataclasses.replace(old, info=info, last_seen_s=max(old.last_seen_s, at_s))
        return is_new

    def heartbeat(self, worker_id: str, load: WorkerLoad, at_s: float | None = None, seq: int = 0) -> bool:
        """Record ``load`` and renew the lease; False (no change) when the worker is not alive.
        A heartbeat numbered ``seq`` at or below the last one applied renews nothing and keeps
        the newer load (a replayed or reordered heartbeat); 0 means unnumbered."""
        at_s = self._clock() if at_s is None else at_s
        entry = self.entry(worker_id, at_s)
        if entry is None:
            return False
        if seq and seq <= entry.heartbeat_seq:
            return True
        self._changed()
        self._entries[worker_id] = WorkerEntry(entry.info, load, max(entry.last_seen_s, at_s),
                                               seq or entry.heartbeat_seq)
        return True

    def renew(self, alive_at_s: float, at_s: float) -> list[str]:
        """Every worker alive at ``alive_at_s`` counts as seen at ``at_s`` (no Conductor could
        hear heartbeats in between: ``clusterstate.log``); their ids, sorted."""
        renewed = sorted(w for w in self._entries if self.is_alive(w, alive_at_s))
        for worker_id in renewed:
            entry = self._entries[worker_id]
            self._entries[worker_id] = dataclasses.replace(entry, last_seen_s=max(entry.last_seen_s, at_s))
        self._changed()
        return renewed

    def remove(self, worker_id: str) -> bool:
        self._changed()
        return self._entries.pop(worker_id, None) is not None

    def workers(self) -> list[tuple[WorkerInfo, WorkerLoad]]:
        return [(self._entries[w].info, self._entries[w].load) for w in self.alive_ids()]

    def entries(self) -> list[WorkerEntry]:
        """Every entry, alive or expired-but-not-reaped, by id (a snapshot of the state)."""
        return [self._entries[w] for w in sorted(self._entries)]

    def restore(self, entry: WorkerEntry) -> None:
        """Put ``entry`` back as it was (a snapshot being loaded)."""
        self._changed()
        self._entries[entry.info.worker_id] = entry

    def known_ids(self) -> set[str]:
        """Every id in the table, alive or expired-but-not-reaped."""
        return set(self._entries)

    def reap_expired(self, grace_s: float = 0.0) -> list[str]:
        """Drop entries expired for ``grace_s`` or more; return their ids, sorted."""
        now_s = self._clock()
        expired = sorted(w for w, e in self._entries.items() if now_s - e.last_seen_s >= self.ttl_s + grace_s)
        for worker_id in expired:
            del self._entries[worker_id]
        self._changed()
        return expired

    def check_integrity(self) -> None:
        for worker_id, entry in self._entries.items():
            assert entry.info.worker_id == worker_id, (worker_id, entry)
            assert entry.heartbeat_seq >= 0, entry
