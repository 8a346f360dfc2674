"""One replica's following of the shared log (``LogFollower``): the reader that applies the
stream in order, where this replica stands in it (position, sequence number, epoch, caught up
or how far behind), and the store's outages as seen here (the outbox of entries kept while it
does not answer, sent in order when it answers again).

The reader starts from the stored snapshot, repairs a gap from it, writes this replica's state
into the log of a store that lost its data, writes a snapshot when one is due (one replica at
a time: the snapshot lock), and on first catching up with a quiet log renews the leases of the
workers alive then. Why, and the whole picture: ``clusterstate.redis_log``; the keys and
commands: ``clusterstate.redis_store``.

Locking: one ``threading.Condition`` guards where this replica stands and the outbox; it is
notified at every entry applied (``wait_applied`` waits on it).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable

import redis
from redis.exceptions import ResponseError

from clusterstate.log import EntryApplier, entry
from clusterstate.log_snapshot import republished, snapshot_workers, state_snapshot
from clusterstate.records import RecordError
from clusterstate.redis_store import UNREACHABLE, LogStore, WarnOnce
from proto import state_pb2 as spb

log = logging.getLogger("clusterstate.redis_log")  # the shared log's one logger (``redis_store``)
EPOCH_CHECK_S = 2.0  # how often an idle reader checks that the store still holds its log


class LogFollower:
    """``make_client``: the reader's own connection (its reads block); ``stop``: the log's, set
    when it closes. ``read_loop`` is the reader's thread; the rest is called from any thread."""

    def __init__(self, make_client: Callable[[], redis.Redis], store: LogStore, applier: EntryApplier,
                 replica_id: str, stop: threading.Event, warn_once: WarnOnce):
        self.replica_id, self.applier, self.config, self.keys = replica_id, applier, store.config, store.keys
        self._make_client, self._store, self._stop, self._warn_once = make_client, store, stop, warn_once
        self._cond = threading.Condition()
        self.position = "0-0"  # the last stream id applied
        self.seq = 0  # its sequence number
        self.epoch: str | None = None
        self._synced = False
        self._caught_up = False
        self._degraded_since: float | None = None
        self._last_read_s = time.time()
        self._behind_since_wall_s = 0.0  # the newest entry's time when the last read was a full batch
        self._restored_newest_s = 0.0  # the newest lease in the snapshot this replica started from
        self._resume_seq: int | None = None  # its LeasesEntry, once written; then caught up once read
        self._resumed = False
        self._outbox: collections.deque[dict[bytes, bytes]] = collections.deque()
        self._since_snapshot = 0
        self._last_snapshot_s = time.monotonic()
        self.delays_s: collections.deque[float] = collections.deque(maxlen=100_000)  # apply time - entry time
        self.num_resyncs = 0
        self._gap_at: tuple[int, str] | None = None

    # ---- where this replica stands ---------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Caught up once since starting, and now either following within ``max_lag_s`` or cut
        off from the store (then every replica serves from what it knows)."""
        with self._cond:
            if not self._synced or not (self._caught_up or self._degraded_since is not None):
                return False
        return self.lag_s <= self.config.max_lag_s or self._degraded_since is not None

    def leases_held_at(self) -> float | None:
        """While this replica cannot follow the log (the store is down, or it is catching up), the
        time its state is current as of: leases are judged then, not now, so that heartbeats it
        has not heard yet do not expire their workers. None while it follows the log."""
        with self._cond:
            if self._degraded_since is not None:
                return self._degraded_since
            if not self._caught_up and self._behind_since_wall_s:
                return self._behind_since_wall_s
            return None

    @property
    def degraded(self) -> bool:
        """The store is unreachable (entries are applied here and kept in the outbox)."""
        return self._degraded_since is not None

    @property
    def lag_s(self) -> float:
        with self._cond:
            if self._degraded_since is not None:
                return max(0.0, time.time() - self._last_read_s)
            if self._caught_up:
                return 0.0
            return max(0.0, time.time() - self._behind_since_wall_s) if self._behind_since_wall_s else math.inf

    def wait_applied(self, seq: int) -> bool:
        """Until the reader applied entry ``seq``: True; False when the store became unreachable
        meanwhile or ``publish_timeout_s`` passed."""
        until = time.monotonic() + self.config.publish_timeout_s
        with self._cond:
            while self.seq < seq and not self._stop.is_set():
                left = until - time.monotonic()
                if self._degraded_since is not None:
                    return False
                if left <= 0:
                    self._warn_once("slow", f"this replica had not applied its own log entry {seq} within "
                                            f"{self.config.publish_timeout_s:g} s (at {self.seq})")
                    return False
                self._cond.wait(min(left, 0.05))
            return True

    def snapshot(self) -> spb.StateSnapshot:
        """This replica's whole state as of the last entry it applied (the reader's thread, or
        a caller that holds the reader still)."""
        with self._cond:
            position, seq, epoch = self.position, self.seq, self.epoch or ""
        return state_snapshot(self.applier.state, self.keys, position, seq, epoch)

    # ---- reading ------------------------------------------------------------------------------
    def read_loop(self) -> None:
        reader = self._make_client()
        next_epoch_check = 0.0
        while not self._stop.is_set():
            try:
                if not self._synced:
                    self._sync(reader)
                elif time.monotonic() >= next_epoch_check:  # a store that came back empty, while idle
                    next_epoch_check = time.monotonic() + EPOCH_CHECK_S
                    if not self._store.holds_epoch(reader, self.epoch):
                        self._synced = False
                        continue
                records = self._store.read(reader, self.position)
                self._recovered()
                if not self._apply_records(records):
                    continue
                caught_up = len(records) < self.config.read_count
                if caught_up and not self._resumed:
                    caught_up = self._resume_leases()
                with self._cond:
                    self._caught_up = caught_up
                    self._cond.notify_all()
                self._maybe_snapshot()
            except UNREACHABLE as e:
                self.mark_degraded(e)
                self._stop.wait(self.config.retry_s)
            except ResponseError as e:  # e.g. the key holds another type: foreign data
                self._warn_once(f"response:{e}", f"the store answered an error ({e}); retrying")
                self._stop.wait(self.config.retry_s)
        reader.close()

    def _apply_records(self, records: list) -> bool:
        """Applies records in order; False when a gap stops it (a resync follows)."""
        now_s = time.time()
        for record_id, fields in records:
            rid = record_id.decode() if isinstance(record_id, bytes) else record_id
            seq_text = fields.get(b"s", b"")
            seq = int(seq_text) if seq_text.isdigit() else -1
            if seq != self.seq + 1:
                self._gap(seq, rid)
                return False
            try:
                state_entry = self.keys.open_entry(fields)
            except RecordError as e:
                self._warn_once(f"record:{rid}", f"dropped log record {rid}: {e}")
                state_entry = None
            if state_entry is not None:
                self.applier.apply(state_entry, own=state_entry.origin == self.replica_id)
                self.delays_s.append(now_s - state_entry.wall_s)
            with self._cond:
                self.position, self.seq = rid, seq
                self._behind_since_wall_s = state_entry.wall_s if state_entry is not None else now_s
                self._since_snapshot += 1
                self._cond.notify_all()
        with self._cond:
            self._last_read_s = now_s
        return True

    def _resume_leases(self) -> bool:
        """On first catching up: whether this replica is caught up. On a quiet log it first
        writes a ``LeasesEntry`` and is caught up once it has read that back (until then its
        leases are held at the log's newest time: ``leases_held_at``)."""
        if self._resume_seq is None:
            now_s = self.applier.state.now()
            quiet_since_s = max(self._behind_since_wall_s, self._restored_newest_s)
            if not quiet_since_s or now_s - quiet_since_s < self.config.quiet_s:
                self._resumed = True
                return True
            leases = entry(self.replica_id, now_s, leases=spb.LeasesEntry(quiet_since_s=quiet_since_s))
            self._resume_seq = self._store.append([self.keys.entry_fields(leases)])[-1]
            log.info("the cluster's log was quiet for %.1f s (no Conductor took heartbeats): the workers alive "
                     "then keep their leases, renewed from now", now_s - quiet_since_s)
        if self.seq < self._resume_seq:
            return False
        self._resumed = True
        return True

    def _gap(self, seq: int, record_id: str) -> None:
        self.num_resyncs += 1
        log.warning("log gap at %s: sequence number %s after %d; repairing from the snapshot", record_id, seq, self.seq)
        with self._cond:
            self._synced = False
            self._caught_up = False
            self._gap_at = (seq, record_id)

    def _sync(self, reader: redis.Redis) -> None:
        """Start, or repair after a gap: from the stored snapshot in the same epoch; after the
        store lost its data (another epoch), on top of the state this replica holds."""
        epoch = self._store.claim_epoch(reader)
        gap, self._gap_at = self._gap_at, None
        if self.epoch is not None and epoch != self.epoch:
            log.warning("the store lost its data (epoch %s, was %s): keeping this replica's state, writing it into "
                        "the new log, reading that on top of it and writing a snapshot of the result", epoch,
                        self.epoch)
            self._republish()
            self.position, self.seq = "0-0", 0
            self._since_snapshot = self.config.snapshot_every_entries  # the next quiet moment writes one
        else:
            snapshot = self._store.stored_snapshot(reader, epoch)
            if snapshot is not None and snapshot.seq > self.seq:
                self._restore(snapshot)
            elif gap is not None:  # no snapshot past the gap: accept the loss, say so, go on
                log.error("log gap at %s cannot be repaired from a snapshot; continuing from sequence number %s "
                          "(entries in between are lost)", gap[1], gap[0])
                self.seq = gap[0] - 1 if gap[0] > 0 else self.seq
        with self._cond:
            self.epoch = epoch
            self._synced = True

    def _republish(self) -> None:
        """This replica's state written into the new log (``log_snapshot.republished``). Other
        replicas that republish too only repeat the same changes."""
        holdings = self.applier.state.export()
        batch = republished(holdings, self.keys, self.replica_id)
        for start in range(0, len(batch), 1000):
            self._store.append(batch[start:start + 1000])
        log.info("wrote this replica's %d workers into the new log", len(holdings))

    def _restore(self, snapshot: spb.StateSnapshot) -> None:
        workers = snapshot_workers(snapshot, self.applier.worker_of)
        self.applier.state.replace(workers)
        self._restored_newest_s = max((w.last_seen_s for w in snapshot.workers), default=0.0)
        with self._cond:
            self.position, self.seq = snapshot.position, snapshot.seq
        log.info("state from the snapshot at %s (sequence number %d): %d workers, %d blocks", snapshot.position,
                 snapshot.seq, len(workers), sum(len(h) for _, h in workers))

    def _maybe_snapshot(self) -> None:
        cfg = self.config
        due = self._since_snapshot >= cfg.snapshot_every_entries or (
            self._since_snapshot and time.monotonic() - self._last_snapshot_s >= cfg.snapshot_every_s)
        if not due or not self._caught_up or self._outbox or self._degraded_since is not None:
            return
        self._since_snapshot, self._last_snapshot_s = 0, time.monotonic()
        if not self._store.lock_snapshot(self.replica_id):
            return  # another replica is writing one
        self._store.put_snapshot(self.snapshot(), self.replica_id)

    # ---- the store's health --------------------------------------------------------------------
    def mark_degraded(self, e: BaseException) -> None:
        with self._cond:
            if self._degraded_since is None:
                self._degraded_since = time.time()
                log.warning("the store is unreachable (%s: %s): serving from this replica's state; log entries are "
                            "kept and sent when it answers again", type(e).__name__, e)

    def keep(self, fields: dict[bytes, bytes]) -> bool:
        """While the store is unreachable: ``fields`` kept in the outbox (the oldest dropped past
        ``max_outbox``), and True; False once it answers again (then the caller appends them)."""
        with self._cond:  # the outbox is drained under this lock before the store counts as back
            if self._degraded_since is None:
                return False
            self._outbox.append(fields)
            while len(self._outbox) > self.config.max_outbox:
                self._outbox.popleft()
                self._warn_once("outbox", "the store has been down long: dropping the oldest unsent log entries")
            return True

    def _recovered(self) -> None:
        """The store answers again: send the outbox, in order, then count it as back (checked
        and switched under the lock that ``keep`` fills the outbox under, so no entry is left
        behind)."""
        if self._degraded_since is None:
            return
        num_sent = 0
        while True:
            with self._cond:
                batch = [self._outbox.popleft() for _ in range(min(1000, len(self._outbox)))]
                if not batch:
                    outage_s = time.time() - self._degraded_since
                    self._degraded_since = None
                    self._caught_up = False  # leases stay held until the reader has read what it missed
                    break
            try:
                self._store.append(batch)
            except UNREACHABLE:
                with self._cond:
                    self._outbox.extendleft(reversed(batch))
                raise
            num_sent += len(batch)
        log.info("the store answers again after %.1f s: sent %d log entries kept meanwhile", outage_s, num_sent)
