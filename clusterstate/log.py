"""The cluster's log: the ordered changes that every Conductor replica applies to its own
``ClusterState``, and the entries one replica shares with the others.

Two kinds of entries (``proto/state.proto``):

- **State entries** (a worker registered, heartbeat with its load and block events, blocks
  a prefill stored, a worker removed, leases renewed after a time with no Conductor) change
  the registry and the block index. ``publish`` appends one and returns once this replica
  has applied it *in log order*, so replicas that applied the same prefix of the log hold
  the same state (``ClusterState.digest``).
- **Overlay entries** (what a replica routed and its progress, a replica's liveness) are
  what the others should count but the writer already did: ``share`` sends one on,
  asynchronously, and only the other replicas apply it (``on_overlay``).

``LocalLog`` is the embedded log of a single Conductor: an entry is applied as it is
published. ``clusterstate.redis_log.RedisLog`` is the log shared through Redis. Both apply
entries through one ``EntryApplier``: the one place a log entry becomes a transition.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from clusterstate.records import RecordError, StoreKeys
from clusterstate.state import ClusterState
from clusterstate.workers import WorkerInfo
from kvstore.index import BlockEvent
from proto import internal_pb2 as ipb
from proto import state_pb2 as spb
from proto.convert import block_event_from_proto, load_from_proto, worker_from_proto, worker_to_proto

log = logging.getLogger(__name__)
OverlayHandler = Callable[[spb.StateEntry], None]


class StateLog(Protocol):
    replica_id: str
    shared: bool  # other replicas read this log (through a store)
    seq: int  # the sequence number of the last entry applied here
    delays_s: Sequence[float]  # recent entries' time from their writer to being applied here

    def start(self) -> None:
        """Catch up with the log (a shared log: from its snapshot), then follow it."""

    def publish(self, entry: spb.StateEntry) -> None:
        """Append a state entry; applied here before this returns (or within its timeout)."""

    def share(self, entry: spb.StateEntry) -> None:
        """Send an overlay entry to the other replicas (asynchronous, best effort)."""

    @property
    def ready(self) -> bool:
        """Caught up with the log, and not lagging beyond the bound."""

    @property
    def lag_s(self) -> float:
        """How far behind the newest entry this replica's state is (seconds; 0 when caught up)."""

    def close(self) -> None: ...


class EntryApplier:
    """Turns log entries into ``ClusterState`` transitions (state entries) or hands them to
    ``on_overlay`` (overlay entries). A malformed entry is dropped and logged, never applied
    in part: the entries come from the store, which is data to verify."""

    def __init__(self, state: ClusterState, keys: StoreKeys, on_overlay: OverlayHandler | None = None):
        self.state, self.keys = state, keys
        self.on_overlay = on_overlay or (lambda entry: None)
        self.num_dropped = 0

    def apply(self, entry: spb.StateEntry, own: bool = False) -> None:
        """Applies ``entry``; ``own``: written by this replica (its overlay entries were
        counted already, so they are not applied again)."""
        kind = entry.WhichOneof("change")
        try:
            if kind == "registered":
                self.state.register(self.worker_of(entry.registered), at_s=entry.wall_s)
            elif kind == "heartbeat":
                hb = entry.heartbeat
                self.state.heartbeat(hb.worker_id, load_from_proto(hb.load), _events(hb.worker_id, hb.events),
                                     at_s=entry.wall_s, seq=hb.seq)
            elif kind == "blocks":
                self.state.apply(_events(entry.blocks.worker_id, entry.blocks.events), at_s=entry.wall_s)
            elif kind == "removed":
                self.state.remove(entry.removed.worker_id)
            elif kind == "leases":
                self.state.renew_leases(entry.leases.quiet_since_s, at_s=entry.wall_s)
            elif kind in ("pending", "replica"):
                if not own:
                    self.on_overlay(entry)
            else:
                raise RecordError(f"log entry of unknown kind {kind!r}")
        except (ValueError, KeyError) as e:  # RecordError is a ValueError
            self.num_dropped += 1
            log.warning("dropped a log entry (%s from %s): %s", kind, entry.origin or "?", e)

    def worker_of(self, record: spb.WorkerRecord) -> WorkerInfo:
        info = ipb.WorkerInfo()
        info.CopyFrom(record.info)
        info.instance_id = self.keys.unseal_instance(info.worker_id, record.sealed_instance_id)
        return worker_from_proto(info)


def _events(worker_id: str, events: Sequence[ipb.BlockEvent]) -> list[BlockEvent]:
    return [block_event_from_proto(worker_id, e) for e in events]


# ---- entries ----------------------------------------------------------------------------------
def entry(origin: str, wall_s: float | None = None, **change: object) -> spb.StateEntry:
    """A log entry of ``origin`` with one change (``registered=...``, ``heartbeat=...``, ...),
    stamped ``wall_s`` (default: now): the time the state's leases count from."""
    return spb.StateEntry(wall_s=time.time() if wall_s is None else wall_s, origin=origin, nonce=os.urandom(8),
                          **change)


def record_of(info: WorkerInfo, keys: StoreKeys) -> spb.WorkerRecord:
    """The registration as the log keeps it: the instance id sealed, never in the clear."""
    public = worker_to_proto(info)
    public.instance_id = ""
    return spb.WorkerRecord(info=public, sealed_instance_id=keys.seal_instance(info.worker_id, info.instance_id))


class LocalLog:
    """The embedded log of a single Conductor: every entry is applied as it is published, in
    publish order (one lock); nothing is shared, since no other replica reads it."""

    shared = False
    delays_s: tuple[float, ...] = ()  # applied as published: no delay

    def __init__(self, applier: EntryApplier, replica_id: str = "local"):
        self.applier, self.replica_id = applier, replica_id
        self.seq = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        pass

    def publish(self, entry: spb.StateEntry) -> None:
        with self._lock:
            self.applier.apply(entry, own=True)
            self.seq += 1

    def share(self, entry: spb.StateEntry) -> None:
        pass

    @property
    def ready(self) -> bool:
        return True

    @property
    def lag_s(self) -> float:
        return 0.0

    def close(self) -> None:
        pass
