"""Shared global index in Redis (``kvstore.index_fallback`` keeps serving while Redis is down).

``RedisIndex`` owns the index's keys under one namespace ``ns`` in a single Redis server
(not Redis Cluster: scripts touch keys they compute). Several Conductors on the same
namespace share one view, and a restarted Conductor finds it intact. Schema:

    ns:blk:<key hex>     hash   worker_id -> "<tier>:<snapshot 0|1>"   (who holds the block)
    ns:wblocks:<worker>  set    key hex of every block the worker holds (purge in O(own blocks))
    ns:worker:<worker>   hash   info=<WorkerInfo json>, load=<WorkerLoad json>; PEXPIRE ttl_s
    ns:workers           set    every registered id, alive or expired-but-not-reaped

A worker is alive while ``ns:worker:<id>`` exists; Redis expires it when heartbeats stop,
which hides its blocks from ``match`` at once. ``reap_expired`` (and a re-registration of
the id) later deletes the dead worker's entries. Every operation is one Lua script run with
``EVALSHA``: a match over any number of keys is one round trip and sees one consistent state.
All scripts are loaded together (``SCRIPT LOAD``, one pipelined round trip) before this
index's first call, so a later ``NOSCRIPT`` means the server lost its script cache: it was
restarted (a server without persistence comes back empty), flushed or failed over. The index
then loads them again and counts the loss in ``server_epoch``, which a mirror of the index
(``FallbackIndex``) compares to notice that Redis forgot what it was told.

Failures: ``redis.exceptions.ConnectionError``/``TimeoutError`` are retried with capped
exponential backoff inside a short total budget, then raised as ``IndexUnavailable``; a call
to a dead or hung server returns within about ``retry_budget_s`` plus one socket timeout.
``kvstore.index_fallback.FallbackIndex`` turns that into answers from a local ``MemoryIndex``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvstore.blocks import BlockKey, Tier
from kvstore.hitrule import usable_length
from kvstore.index import (
    BlockEvent,
    GlobalIndex,
    IndexUnavailable,
    MatchSnapshot,
    WorkerInfo,
    WorkerLoad,
    WorkerMatch,
    WorkerRole,
    check_keys,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
assert max(Tier) < 10, "the scripts encode a tier as one decimal digit"
_TIER_OF_DIGIT = bytes.maketrans(b"0123456789", bytes(range(10)))  # b"1" -> Tier.DRAM's byte
_FLAG_OF_DIGIT = _TIER_OF_DIGIT  # b"0" / b"1" -> the 0 / 1 flags of hitrule.usable_length

# Shared Lua prelude. purge(w): drop every block entry of worker w (ARGV[1] is the namespace).
_PRELUDE = """
local ns = ARGV[1]
local function purge(w)
  local ws = ns .. ':wblocks:' .. w
  for _, k in ipairs(redis.call('SMEMBERS', ws)) do redis.call('HDEL', ns .. ':blk:' .. k, w) end
  redis.call('DEL', ws)
end
local function alive(w) return redis.call('EXISTS', ns .. ':worker:' .. w) == 1 end
"""

# ARGV: ns, then (worker, key hex, "<tier>:<snap>" or "-" for removed) per event.
_APPLY = """
local is_alive, num_applied = {}, 0
for i = 2, #ARGV, 3 do
  local w, k, v = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if is_alive[w] == nil then is_alive[w] = alive(w) end
  if is_alive[w] then
    if v == '-' then
      redis.call('HDEL', ns .. ':blk:' .. k, w)
      redis.call('SREM', ns .. ':wblocks:' .. w, k)
    else
      redis.call('HSET', ns .. ':blk:' .. k, w, v)
      redis.call('SADD', ns .. ':wblocks:' .. w, k)
    end
    num_applied = num_applied + 1
  end
end
return num_applied
"""

# ARGV: ns, the keys' hex concatenated (32 characters each). Returns, per alive worker, its id
# and the "<tier>:<snap>" values of its held prefix concatenated (3 characters a block). One
# HMGET per key asks only the workers whose prefix is still open; the scan ends when none is.
_MATCH = """
local order, held = {}, {}
for _, w in ipairs(redis.call('SMEMBERS', ns .. ':workers')) do
  if alive(w) then order[#order + 1] = w; held[#order] = {} end
end
local open, names = {}, {}
for j = 1, #order do open[j] = j; names[j] = order[j] end
local hexs, blk = ARGV[2], ns .. ':blk:'
for i = 1, #hexs, 32 do
  if #open == 0 then break end
  local values, closed = redis.call('HMGET', blk .. string.sub(hexs, i, i + 31), unpack(names)), false
  for j = 1, #open do
    local v = values[j]
    if v then local h = held[open[j]]; h[#h + 1] = v else closed = true end
  end
  if closed then
    local still, still_names = {}, {}
    for j = 1, #open do
      if values[j] then still[#still + 1] = open[j]; still_names[#still_names + 1] = names[j] end
    end
    open, names = still, still_names
  end
end
local out = {}
for j = 1, #order do out[#out + 1] = order[j]; out[#out + 1] = table.concat(held[j]) end
return out
"""

# ARGV: ns, worker, info json, initial load json, ttl ms. Returns 1 for a new incarnation.
_REGISTER = """
local w = ARGV[2]
local wk = ns .. ':worker:' .. w
local is_new = not alive(w)
if is_new then purge(w); redis.call('HSET', wk, 'load', ARGV[4]) end
redis.call('HSET', wk, 'info', ARGV[3])
redis.call('PEXPIRE', wk, ARGV[5])
redis.call('SADD', ns .. ':workers', w)
return is_new and 1 or 0
"""

# ARGV: ns, worker, load json, ttl ms. Returns 0 when the worker is not alive.
_HEARTBEAT = """
local wk = ns .. ':worker:' .. ARGV[2]
if redis.call('EXISTS', wk) == 0 then return 0 end
redis.call('HSET', wk, 'load', ARGV[3])
redis.call('PEXPIRE', wk, ARGV[4])
return 1
"""

# ARGV: ns, worker. Returns 1 when the worker was known.
_REMOVE = """
local w = ARGV[2]
purge(w)
redis.call('DEL', ns .. ':worker:' .. w)
return redis.call('SREM', ns .. ':workers', w)
"""

# ARGV: ns. Returns the ids of purged (expired) workers.
_REAP = """
local reaped = {}
for _, w in ipairs(redis.call('SMEMBERS', ns .. ':workers')) do
  if not alive(w) then purge(w); redis.call('SREM', ns .. ':workers', w); reaped[#reaped + 1] = w end
end
return reaped
"""

# ARGV: ns, worker, info json, load json, ttl ms. Whatever Redis held for the worker is dropped
# and it is alive with exactly this info and load (a resync then re-applies its blocks).
_RESET = """
local w = ARGV[2]
local wk = ns .. ':worker:' .. w
purge(w)
redis.call('DEL', wk)
redis.call('HSET', wk, 'info', ARGV[3], 'load', ARGV[4])
redis.call('PEXPIRE', wk, ARGV[5])
redis.call('SADD', ns .. ':workers', w)
return 1
"""

# ARGV: ns. Returns (info json, load json) per alive worker.
_WORKERS = """
local out = {}
for _, w in ipairs(redis.call('SMEMBERS', ns .. ':workers')) do
  local v = redis.call('HMGET', ns .. ':worker:' .. w, 'info', 'load')
  if v[1] then out[#out + 1] = v[1]; out[#out + 1] = v[2] end
end
return out
"""

_BODIES = dict(apply=_APPLY, match=_MATCH, register=_REGISTER, heartbeat=_HEARTBEAT, remove=_REMOVE)
_BODIES.update(reap=_REAP, workers=_WORKERS, reset=_RESET)
_SCRIPTS = {name: _PRELUDE + body for name, body in _BODIES.items()} | {"ping": "return 1"}
_SHAS = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in _SCRIPTS.items()}


@dataclasses.dataclass(frozen=True, slots=True)
class RedisIndexConfig:
    """Lease and failure handling. Worst case per call is about ``retry_budget_s`` + one timeout.

    ``socket_timeout_s`` bounds one reply of a connected but hung server; the largest script
    (an apply of ``num_events_per_script`` events) takes milliseconds, far below it.
    """

    ttl_s: float = 10.0
    connect_timeout_s: float = 0.25
    socket_timeout_s: float = 0.5
    num_retries: int = 3
    backoff_base_s: float = 0.02
    backoff_cap_s: float = 0.2
    retry_budget_s: float = 0.5
    num_events_per_script: int = 4096

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 0:
                raise ValueError(f"{field.name} must be >= 0, got {getattr(self, field.name)}")
        if self.ttl_s <= 0 or self.num_events_per_script <= 0:
            raise ValueError(f"ttl_s and num_events_per_script must be positive: {self}")

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    def backoff_s(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (0-based): base * 2**attempt, capped."""
        return min(self.backoff_cap_s, self.backoff_base_s * 2**attempt)


class RedisIndex(GlobalIndex):
    """``GlobalIndex`` in Redis. Thread-safe: redis-py's pool gives each call its own connection;
    ``_scripts_lock`` guards only the loaded flag and ``server_epoch`` (never held over I/O)."""

    def __init__(
        self,
        url: str,
        namespace: str = "tidekv",
        config: RedisIndexConfig | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Connects lazily: constructing never fails for an unreachable server. ``sleep`` backs off."""
        if not namespace or any(c.isspace() for c in namespace):
            raise ValueError(f"namespace must be non-empty without whitespace, got {namespace!r}")
        self.url = url
        self.namespace = namespace
        self.config = config or RedisIndexConfig()
        self._sleep = sleep
        # Retries are ours (_call) so the whole budget is bounded; redis-py must not add its own.
        self._client = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=self.config.connect_timeout_s,
            socket_timeout=self.config.socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._scripts_lock = threading.Lock()
        self._scripts_loaded = False  # this index loaded every script on the server at least once
        self._server_epoch = 0

    @property
    def server_epoch(self) -> int:
        """How often the server was found without this index's scripts after loading them: each
        count is a restart, flush or failover, after which Redis may have lost every key."""
        return self._server_epoch

    def apply(self, events: Sequence[BlockEvent]) -> int:
        num_applied = 0
        step = self.config.num_events_per_script
        for start in range(0, len(events), step):
            args: list[str] = [self.namespace]
            for event in events[start : start + step]:
                value = "-" if event.tier is None else f"{int(event.tier)}:{int(event.has_snapshot)}"
                args += (event.worker_id, event.key.hex(), value)
            num_applied += self._call(lambda a=args: self._eval("apply", a))
        return num_applied

    def match(self, keys: Sequence[BlockKey]) -> MatchSnapshot:
        check_keys(keys)
        flat = self._call(lambda: self._eval("match", [self.namespace, b"".join(keys).hex()]))
        matches = []
        for i in range(0, len(flat), 2):
            values = flat[i + 1].encode()  # "<tier>:<snap>" per block: tiers at 0::3, snapshots at 2::3
            tiers = values[0::3].translate(_TIER_OF_DIGIT)
            matches.append(WorkerMatch(flat[i], len(tiers), usable_length(values[2::3].translate(_FLAG_OF_DIGIT)),
                                       tiers))
        return MatchSnapshot(len(keys), tuple(sorted(matches, key=lambda m: m.worker_id)))

    def register(self, worker: WorkerInfo) -> bool:
        args = [self.namespace, worker.worker_id, _to_json(worker), _to_json(WorkerLoad.initial(worker))]
        return bool(self._call(lambda: self._eval("register", [*args, self.config.ttl_ms])))

    def heartbeat(self, worker_id: str, load: WorkerLoad) -> bool:
        args = [self.namespace, worker_id, _to_json(load), self.config.ttl_ms]
        return bool(self._call(lambda: self._eval("heartbeat", args)))

    def workers(self) -> list[tuple[WorkerInfo, WorkerLoad]]:
        flat = self._call(lambda: self._eval("workers", [self.namespace]))
        pairs = [
            (_info_from_json(flat[i]), _load_from_json(flat[i + 1])) for i in range(0, len(flat), 2)
        ]
        return sorted(pairs, key=lambda pair: pair[0].worker_id)

    def remove(self, worker_id: str) -> bool:
        return bool(self._call(lambda: self._eval("remove", [self.namespace, worker_id])))

    def reap_expired(self) -> tuple[str, ...]:
        return tuple(sorted(self._call(lambda: self._eval("reap", [self.namespace]))))

    def reset_worker(self, worker: WorkerInfo, load: WorkerLoad) -> None:
        """Make ``worker`` alive with exactly ``load`` and no blocks, dropping what Redis held
        for it (its old blocks, a stale load). A resync then applies the blocks it holds."""
        args = [self.namespace, worker.worker_id, _to_json(worker), _to_json(load), self.config.ttl_ms]
        self._call(lambda: self._eval("reset", args))

    def ping(self) -> None:
        """One round trip (loading the scripts if the server lost them, which ``server_epoch``
        then shows); raises ``IndexUnavailable`` like every other call."""
        self._call(lambda: self._eval("ping", []))

    def close(self) -> None:
        self._client.close()

    def _eval(self, name: str, args: Sequence[object]) -> Any:
        """``EVALSHA`` of script ``name``; loads every script first on this index's first call
        and again after a ``NOSCRIPT`` (then counted in ``server_epoch``)."""
        if not self._scripts_loaded:
            self._load_scripts(lost=False)
        try:
            return self._client.evalsha(_SHAS[name], 0, *args)
        except NoScriptError:
            self._load_scripts(lost=True)
            return self._client.evalsha(_SHAS[name], 0, *args)

    def _load_scripts(self, lost: bool) -> None:
        """``lost``: after a ``NOSCRIPT``, so the server forgot scripts this index had loaded."""
        pipe = self._client.pipeline(transaction=False)
        for text in _SCRIPTS.values():
            pipe.script_load(text)
        pipe.execute()
        with self._scripts_lock:
            if lost:
                self._server_epoch += 1
                logger.info("redis %s had lost this index's scripts (restarted or flushed); reloaded", self.url)
            self._scripts_loaded = True

    def _call(self, op: Callable[[], T]) -> T:
        """Run ``op``; retry connection failures with capped backoff; raise ``IndexUnavailable``."""
        deadline_s = time.monotonic() + self.config.retry_budget_s
        attempt = 0
        while True:
            try:
                return op()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                delay_s = self.config.backoff_s(attempt)
                if attempt >= self.config.num_retries or time.monotonic() + delay_s > deadline_s:
                    raise IndexUnavailable(self.url, exc) from exc
                logger.debug("redis %s unreachable (attempt %d): %s", self.url, attempt, exc)
            self._sleep(delay_s)
            attempt += 1


def _to_json(value: WorkerInfo | WorkerLoad) -> str:
    return json.dumps(dataclasses.asdict(value), sort_keys=True)


# Parsed values by their JSON text (frozen, so shared safely): every routing decision reads
# every worker's info and load, which change only at registration and with each heartbeat.
@functools.lru_cache(maxsize=1024)
def _info_from_json(text: str) -> WorkerInfo:
    fields = json.loads(text)
    return WorkerInfo(**{**fields, "role": WorkerRole(fields["role"])})


@functools.lru_cache(maxsize=1024)
def _load_from_json(text: str) -> WorkerLoad:
    return WorkerLoad.from_dict(json.loads(text))
