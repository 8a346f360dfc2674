"""The shared log's keys in the store and every command on them (``LogStore``), and the log's
settings (``RedisLogConfig``, imported from ``clusterstate.redis_log`` where it is documented).

Commands only: appending entries (one Lua script: INCR, then XADD per entry; then WAIT for a
Redis replica), reading the stream after a position, the epoch, the stored snapshot and its
lock, and a signature nonce's first use. The key layout and why appends are one script:
``clusterstate.redis_log``. Which position to read, when a snapshot is due and what to do
while the store does not answer belong to ``clusterstate.redis_follow`` and
``clusterstate.redis_log``; every command here raises what redis-py raises (``UNREACHABLE``:
the store does not answer).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from clusterstate.log_snapshot import PUT_SNAPSHOT, SNAPSHOT_LOCK_MS
from clusterstate.records import RecordError, StoreKeys
from proto import state_pb2 as spb

# The shared log logs as one, whichever of its modules writes: operators configure it by this name.
log = logging.getLogger("clusterstate.redis_log")
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)

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


class WarnOnce:
    """Logs a warning once for each ``what`` (at most 10,000 of them), so that a record or a
    store that keeps failing the same way does not flood the log. One per log, shared by its
    parts; not locked (a race at worst logs one warning twice)."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def __call__(self, what: str, message: str) -> None:
        if what not in self._warned and len(self._warned) < 10_000:
            self._warned.add(what)
            log.warning("%s", message)


class LogStore:
    """The keys under ``config.namespace`` and the commands on them. Writes go through
    ``client`` (its scripts are registered on it); reads take the reader's own connection, as
    they block. No state of its own but when to skip WAIT; redis-py clients are thread-safe."""

    def __init__(self, client: redis.Redis, keys: StoreKeys, config: RedisLogConfig, warn_once: WarnOnce):
        self.keys, self.config = keys, config
        self._redis, self._warn_once = client, warn_once
        ns = config.namespace
        self._stream, self._seq_key, self._epoch_key = f"{ns}:log", f"{ns}:seq", f"{ns}:epoch"
        self._snapshot_key, self._lock_key, self._nonce_prefix = f"{ns}:snapshot", f"{ns}:snaplock", f"{ns}:nonce:"
        self._append = client.register_script(_APPEND)
        self._put_snapshot = client.register_script(PUT_SNAPSHOT)
        self._skip_wait_until = 0.0

    def close(self) -> None:
        self._redis.close()

    # ---- writing ------------------------------------------------------------------------------
    def append(self, batch: list[dict[bytes, bytes]]) -> list[int]:
        """Appends entries (``StoreKeys.entry_fields``) in order: their sequence numbers."""
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

    def first_use(self, nonce: str, expires_s: float) -> bool:
        """True the first time any replica sets ``nonce``, until ``expires_s`` (wall seconds)."""
        ms = max(1, int((expires_s - time.time()) * 1000))
        return bool(self._redis.set(self._nonce_prefix + nonce, b"1", nx=True, px=ms))

    def lock_snapshot(self, replica_id: str) -> bool:
        """True when ``replica_id`` now holds the snapshot lock (released when its snapshot is
        stored, or after ``SNAPSHOT_LOCK_MS``); False while another replica writes one."""
        return bool(self._redis.set(self._lock_key, replica_id, nx=True, px=SNAPSHOT_LOCK_MS))

    def put_snapshot(self, snapshot: spb.StateSnapshot, replica_id: str) -> None:
        """Stores ``snapshot`` unless a newer one is stored, trims the stream up to the one it
        replaces, releases ``replica_id``'s lock (``log_snapshot.PUT_SNAPSHOT``)."""
        self._put_snapshot(keys=[self._snapshot_key, self._stream, self._lock_key],
                           args=[snapshot.seq, snapshot.position, snapshot.epoch, self.keys.seal_snapshot(snapshot),
                                 replica_id])

    # ---- reading (on the reader's connection) ----------------------------------------------------
    def read(self, reader: redis.Redis, position: str) -> list:
        """Up to ``read_count`` records after ``position`` (stream id, fields), waiting up to
        ``read_block_ms`` for the first."""
        resp = reader.xread({self._stream: position}, count=self.config.read_count, block=self.config.read_block_ms)
        return resp[0][1] if resp else []

    def claim_epoch(self, reader: redis.Redis) -> str:
        """The store's epoch, set to a new random one first when it has none (it is empty)."""
        reader.set(self._epoch_key, os.urandom(8).hex(), nx=True)
        return reader.get(self._epoch_key).decode()

    def holds_epoch(self, reader: redis.Redis, epoch: str) -> bool:
        """Whether the store still holds the log of ``epoch`` (False: it came back empty)."""
        return reader.get(self._epoch_key) == epoch.encode()

    def stored_snapshot(self, reader: redis.Redis, epoch: str) -> spb.StateSnapshot | None:
        """The stored snapshot when it is one of ``epoch``'s and its MAC holds; else None."""
        fields = reader.hgetall(self._snapshot_key)
        if not fields:
            return None
        try:
            snapshot = self.keys.open_snapshot(fields.get(b"blob", b""))
        except RecordError as e:
            self._warn_once("snapshot", f"ignored the stored snapshot: {e}")
            return None
        return snapshot if snapshot.epoch == epoch else None
