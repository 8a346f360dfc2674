"""The cluster's log shared through Redis: one stream that every Conductor replica follows
into its own ``ClusterState``, with snapshots to start from, gap repair and outage tolerance.

Keys under one namespace ``ns`` (one Redis primary; Sentinel for its high availability):

    ns:log       stream   one record per entry: s = sequence number, e = entry, m = MAC
    ns:seq       string   the last sequence number handed out (INCR in the append script)
    ns:epoch     string   random, set once: a different one means the store lost its data
    ns:snapshot  hash     seq, position, epoch, blob: the whole state as of one position
    ns:snaplock  string   who writes the next snapshot (SET NX PX)
    ns:nonce:<n> string   a signature's nonce, once (``first_use``), expiring with its window

Appending is one Lua script (INCR, then XADD per entry), so sequence numbers follow stream
order and a reader detects every gap: a sequence number that is not the next one means
entries were trimmed past it or the store failed over or restarted. It then repairs from
the snapshot (the stream is never trimmed past the stored snapshot's position), or, when the
epoch changed (the store came back empty), keeps its own state, reads the new stream from
its start on top of it and writes a snapshot of the result, so replicas that start later
find the cluster again.

The stream is trimmed at each snapshot up to the one before it: a replica less than a
snapshot interval behind reads on, one further behind repairs.

A replica that starts on a quiet log (nothing written for ``quiet_s``: no Conductor was
taking heartbeats, so a whole-cluster restart or a lone Conductor's crash) renews the leases
of the workers alive when it went quiet (a ``LeasesEntry``) before it counts as caught up:
the time in which no one could hear a worker is not held against it, and a worker whose
link to the new Conductor takes a moment to reconnect is not dropped from under the
requests routed to it meanwhile.

A state entry's ``publish`` appends it and waits until this replica's reader has applied it
(the reader wakes as soon as the entry is added: XREAD BLOCK), so every replica applies state
entries in the one stream order. While the store is unreachable, ``publish`` applies the
entry here at once and keeps it in an outbox, sent when the store answers again (the reader
then applies it a second time in stream order, which converges: every transition is a
last-writer-wins per worker and block); routing never waits on the store: it reads only the
local state. Overlay entries (``share``) go out from a background thread in batches.

Every record read is verified (``clusterstate.records``): a malformed, oversized or foreign
record is dropped and logged once; it never stops the reader. Thread-safe. What a snapshot
holds and how a whole state is written into a new log: ``clusterstate.log_snapshot``.

This module owns the log's face (``RedisLog``: its life, ``publish``, ``share`` and
``first_use``, and the thread that sends shared entries); the reader, where this replica
stands and the outbox are ``clusterstate.redis_follow``'s; the keys, the scripts and the
settings (``RedisLogConfig``, imported here) are ``clusterstate.redis_store``'s.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import redis

from clusterstate.log import EntryApplier, entry
from clusterstate.records import StoreKeys
from clusterstate.redis_follow import LogFollower
from clusterstate.redis_store import UNREACHABLE, LogStore, RedisLogConfig, WarnOnce
from proto import state_pb2 as spb

__all__ = ["RedisLog", "RedisLogConfig"]
_DEFAULT_CONFIG = RedisLogConfig()  # the signature's default, made once


class RedisLog:
    """``client``: makes a Redis client (``clusterstate.redis_conn.connect``); the reader gets a
    connection of its own for its blocking reads."""

    shared = True

    def __init__(self, client: Callable[[], redis.Redis], applier: EntryApplier, keys: StoreKeys,
                 replica_id: str, config: RedisLogConfig = _DEFAULT_CONFIG):
        self.replica_id, self.config, self.applier, self.keys = replica_id, config, applier, keys
        warn_once = WarnOnce()
        self._store = LogStore(client(), keys, config, warn_once)
        self._stop = threading.Event()
        self._follower = LogFollower(client, self._store, applier, replica_id, self._stop, warn_once)
        self._shared: collections.deque[spb.StateEntry] = collections.deque()
        self._share_wakeup = threading.Event()
        applier.state.hold_leases = self.leases_held_at
        self._threads = [threading.Thread(target=self._follower.read_loop, name="state-log-reader", daemon=True),
                         threading.Thread(target=self._share_loop, name="state-log-sharer", daemon=True)]

    # ---- life ---------------------------------------------------------------------------------
    def start(self) -> None:
        for t in self._threads:
            t.start()

    def close(self) -> None:
        self._stop.set()
        self._share_wakeup.set()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=5)
        self._store.close()

    # ---- where this replica stands (``LogFollower``) -----------------------------------------------
    @property
    def ready(self) -> bool:
        """Caught up once since starting, and now either following within ``max_lag_s`` or cut
        off from the store (then every replica serves from what it knows)."""
        return self._follower.ready

    def leases_held_at(self) -> float | None:
        """The time leases are judged at while this replica cannot follow the log; None while it
        does (``LogFollower.leases_held_at``)."""
        return self._follower.leases_held_at()

    @property
    def degraded(self) -> bool:
        """The store is unreachable (entries are applied here and kept in the outbox)."""
        return self._follower.degraded

    @property
    def lag_s(self) -> float:
        return self._follower.lag_s

    @property
    def position(self) -> str:
        """The last stream id applied."""
        return self._follower.position

    @property
    def seq(self) -> int:
        """The sequence number of the last entry applied."""
        return self._follower.seq

    @property
    def epoch(self) -> str | None:
        return self._follower.epoch

    @property
    def delays_s(self) -> collections.deque[float]:
        """Recent entries' apply time - entry time."""
        return self._follower.delays_s

    @property
    def num_resyncs(self) -> int:
        return self._follower.num_resyncs

    def snapshot(self) -> spb.StateSnapshot:
        """This replica's whole state as of the last entry it applied (the reader's thread, or
        a caller that holds the reader still)."""
        return self._follower.snapshot()

    # ---- writing ------------------------------------------------------------------------------
    def publish(self, state_entry: spb.StateEntry) -> None:
        fields = self.keys.entry_fields(state_entry)
        while True:
            if not self._follower.degraded:
                try:
                    seqs = self._store.append([fields])
                except UNREACHABLE as e:
                    self._follower.mark_degraded(e)
                else:
                    if not self._follower.wait_applied(seqs[-1]):
                        # In the log, but this replica's reader cannot reach it now: apply it here
                        # too (it is applied again, to the same effect, when the reader gets to it).
                        self.applier.apply(state_entry, own=True)
                    return
            if self._follower.keep(fields):
                break
        self.applier.apply(state_entry, own=True)  # serve from what this replica knows meanwhile

    def share(self, overlay_entry: spb.StateEntry) -> None:
        self._shared.append(overlay_entry)
        self._share_wakeup.set()

    def first_use(self, nonce: str, expires_s: float) -> bool:
        """True the first time any replica sees ``nonce`` (a signature's), until ``expires_s``
        (wall seconds); while the store is down, True (each replica's own nonce memory still
        refuses replays to it)."""
        try:
            return self._store.first_use(nonce, expires_s)
        except UNREACHABLE as e:
            self._follower.mark_degraded(e)
            return True

    def _share_loop(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            self._share_wakeup.wait(self.config.replica_beat_s)
            self._share_wakeup.clear()
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.config.replica_beat_s
                self._shared.append(entry(self.replica_id, replica=spb.ReplicaEntry(replica_id=self.replica_id)))
            time.sleep(self.config.share_interval_s)  # let a burst gather into one append
            batch = []
            while self._shared and len(batch) < 1000:
                batch.append(self.keys.entry_fields(self._shared.popleft()))
            if batch and not self._follower.degraded:
                try:
                    self._store.append(batch)
                except UNREACHABLE as e:  # overlay entries are best effort: dropped
                    self._follower.mark_degraded(e)
            if self._shared:
                self._share_wakeup.set()
