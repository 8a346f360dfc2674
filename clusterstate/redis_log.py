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
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from clusterstate.log import EntryApplier, entry
from clusterstate.log_snapshot import PUT_SNAPSHOT, SNAPSHOT_LOCK_MS, republished, snapshot_workers, state_snapshot
from clusterstate.records import RecordError, StoreKeys
from proto import state_pb2 as spb

log = logging.getLogger(__name__)
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
EPOCH_CHECK_S = 2.0  # how often an idle reader checks that the store still holds its log

_APPEND = """
local out = {}
for i = 2, #ARGV, 2 do
  local s = redis.call('INCR', KEYS[2])
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 's', s, 'e', ARGV[i], 'm', ARGV[i + 1])
  out[#out + 1] = s
end
return out
"""


@dataclass(frozen=True)
class RedisLogConfig:
    namespace: str = "tidekv"
    max_entries: int = 1_000_000  # the stream's cap (it is trimmed at every snapshot anyway)
    snapshot_every_entries: int = 5_000
    snapshot_every_s: float = 30.0
    read_block_ms: int = 200
    read_count: int = 2_000
    publish_timeout_s: float = 2.0  # longest wait for this replica to apply its own entry
    max_lag_s: float = 5.0  # behind by more than this: not ready
    replicas_wait: int = 0  # WAIT for this many Redis replicas after an append (Sentinel: 1)
    replicas_wait_ms: int = 200
    retry_s: float = 0.5
    max_outbox: int = 200_000  # entries kept while the store is down (older ones are dropped)
    share_interval_s: float = 0.002  # how long shared entries gather into one append
    replica_beat_s: float = 1.0
    # A log this long without an entry, when a replica starts, had no Conductor writing to it
    # (an alive one writes each worker's heartbeats): the leases are renewed (``LeasesEntry``).
    quiet_s: float = 1.0

    def __post_init__(self) -> None:
        if self.read_count < 1 or self.snapshot_every_entries < 1 or self.max_lag_s <= 0:
            raise ValueError(f"read_count, snapshot_every_entries and max_lag_s must be positive: {self}")


class RedisLog:
    """``client``: makes a Redis client (``clusterstate.redis_conn.connect``); the reader gets a
    connection of its own for its blocking reads."""

    shared = True

    def __init__(self, client: Callable[[], redis.Redis], applier: EntryApplier, keys: StoreKeys,
                 replica_id: str, config: RedisLogConfig = RedisLogConfig()):
        self.replica_id, self.config, self.applier, self.keys = replica_id, config, applier, keys
        self._make_client = client
        self._redis = client()
        ns = config.namespace
        self._stream, self._seq_key, self._epoch_key = f"{ns}:log", f"{ns}:seq", f"{ns}:epoch"
        self._snapshot_key, self._lock_key, self._nonce_prefix = f"{ns}:snapshot", f"{ns}:snaplock", f"{ns}:nonce:"
        self._append = self._redis.register_script(_APPEND)
        self._put_snapshot = self._redis.register_script(PUT_SNAPSHOT)
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
        self._shared: collections.deque[spb.StateEntry] = collections.deque()
        self._share_wakeup = threading.Event()
        self._since_snapshot = 0
        self._last_snapshot_s = time.monotonic()
        self.delays_s: collections.deque[float] = collections.deque(maxlen=100_000)  # apply time - entry time
        self.num_resyncs = 0
        self._warned: set[str] = set()
        self._gap_at: tuple[int, str] | None = None
        self._skip_wait_until = 0.0
        self._stop = threading.Event()
        applier.state.hold_leases = self.leases_held_at
        self._threads = [threading.Thread(target=self._read_loop, name="state-log-reader", daemon=True),
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
        self._redis.close()

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

    # ---- writing ------------------------------------------------------------------------------
    def publish(self, state_entry: spb.StateEntry) -> None:
        fields = self.keys.entry_fields(state_entry)
        while True:
            if self._degraded_since is None:
                try:
                    seqs = self._append_fields([fields])
                except UNREACHABLE as e:
                    self._mark_degraded(e)
                else:
                    if not self._wait_applied(seqs[-1]):
                        # In the log, but this replica's reader cannot reach it now: apply it here
                        # too (it is applied again, to the same effect, when the reader gets to it).
                        self.applier.apply(state_entry, own=True)
                    return
            with self._cond:  # the outbox is drained under this lock before the store counts as back
                if self._degraded_since is not None:
                    self._outbox.append(fields)
                    while len(self._outbox) > self.config.max_outbox:
                        self._outbox.popleft()
                        self._warn_once("outbox", "the store has been down long: dropping the oldest unsent "
                                                  "log entries")
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
            ms = max(1, int((expires_s - time.time()) * 1000))
            return bool(self._redis.set(self._nonce_prefix + nonce, b"1", nx=True, px=ms))
        except UNREACHABLE as e:
            self._mark_degraded(e)
            return True

    def _append_fields(self, batch: list[dict[bytes, bytes]]) -> list[int]:
        args: list[bytes | int] = [self.config.max_entries]
        for fields in batch:
            args += [fields[b"e"], fields[b"m"]]
        seqs = [int(s) for s in self._append(keys=[self._stream, self._seq_key], args=args)]
        if self.config.replicas_wait and time.monotonic() >= self._skip_wait_until:
            # Acknowledged by a Redis replica too, so that a failover to it loses nothing of
            # what this replica went on from; a primary left without replicas is not waited on
            # (for a while) rather than slowing every append by the timeout.
            acked = self._redis.execute_command("WAIT", self.config.replicas_wait, self.config.replicas_wait_ms)
            if int(acked) < self.config.replicas_wait:
                self._skip_wait_until = time.monotonic() + 10.0
                self._warn_once(f"wait:{self._skip_wait_until // 60}", "the store's primary has no replica "
                                f"acknowledging appends ({acked} of {self.config.replicas_wait}); not waiting for one")
        return seqs

    def _wait_applied(self, seq: int) -> bool:
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
            if batch and self._degraded_since is None:
                try:
                    self._append_fields(batch)
                except UNREACHABLE as e:  # overlay entries are best effort: dropped
                    self._mark_degraded(e)
            if self._shared:
                self._share_wakeup.set()

    # ---- reading ------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        reader = self._make_client()
        next_epoch_check = 0.0
        while not self._stop.is_set():
            try:
                if not self._synced:
                    self._sync(reader)
                elif time.monotonic() >= next_epoch_check:  # a store that came back empty, while idle
                    next_epoch_check = time.monotonic() + EPOCH_CHECK_S
                    if reader.get(self._epoch_key) != self.epoch.encode():
                        self._synced = False
                        continue
                resp = reader.xread({self._stream: self.position}, count=self.config.read_count,
                                    block=self.config.read_block_ms)
                self._recovered()
                records = resp[0][1] if resp else []
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
                self._mark_degraded(e)
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
            self._resume_seq = self._append_fields([self.keys.entry_fields(leases)])[-1]
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
        reader.set(self._epoch_key, os.urandom(8).hex(), nx=True)
        epoch = reader.get(self._epoch_key).decode()
        gap, self._gap_at = self._gap_at, None
        if self.epoch is not None and epoch != self.epoch:
            log.warning("the store lost its data (epoch %s, was %s): keeping this replica's state, writing it into "
                        "the new log, reading that on top of it and writing a snapshot of the result", epoch,
                        self.epoch)
            self._republish()
            self.position, self.seq = "0-0", 0
            self._since_snapshot = self.config.snapshot_every_entries  # the next quiet moment writes one
        else:
            snapshot = self._stored_snapshot(reader, epoch)
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
            self._append_fields(batch[start:start + 1000])
        log.info("wrote this replica's %d workers into the new log", len(holdings))

    def _stored_snapshot(self, reader: redis.Redis, epoch: str) -> spb.StateSnapshot | None:
        fields = reader.hgetall(self._snapshot_key)
        if not fields:
            return None
        try:
            snapshot = self.keys.open_snapshot(fields.get(b"blob", b""))
        except RecordError as e:
            self._warn_once("snapshot", f"ignored the stored snapshot: {e}")
            return None
        return snapshot if snapshot.epoch == epoch else None

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
        if not self._redis.set(self._lock_key, self.replica_id, nx=True, px=SNAPSHOT_LOCK_MS):
            return  # another replica is writing one
        snapshot = self.snapshot()
        self._put_snapshot(keys=[self._snapshot_key, self._stream, self._lock_key],
                           args=[snapshot.seq, snapshot.position, snapshot.epoch, self.keys.seal_snapshot(snapshot),
                                 self.replica_id])

    def snapshot(self) -> spb.StateSnapshot:
        """This replica's whole state as of the last entry it applied (the reader's thread, or
        a caller that holds the reader still)."""
        with self._cond:
            position, seq, epoch = self.position, self.seq, self.epoch or ""
        return state_snapshot(self.applier.state, self.keys, position, seq, epoch)

    # ---- the store's health --------------------------------------------------------------------
    def _mark_degraded(self, e: BaseException) -> None:
        with self._cond:
            if self._degraded_since is None:
                self._degraded_since = time.time()
                log.warning("the store is unreachable (%s: %s): serving from this replica's state; log entries are "
                            "kept and sent when it answers again", type(e).__name__, e)

    def _recovered(self) -> None:
        """The store answers again: send the outbox, in order, then count it as back (checked
        and switched under the lock that ``publish`` fills the outbox under, so no entry is
        left behind)."""
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
                self._append_fields(batch)
            except UNREACHABLE:
                with self._cond:
                    self._outbox.extendleft(reversed(batch))
                raise
            num_sent += len(batch)
        log.info("the store answers again after %.1f s: sent %d log entries kept meanwhile", outage_s, num_sent)

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned and len(self._warned) < 10_000:
            self._warned.add(what)
            log.warning("%s", message)

