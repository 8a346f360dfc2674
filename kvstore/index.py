"""Global index interface: which worker holds which block at which tier, plus the worker registry.

This module owns the *contract* and its frozen value types; it holds no state. Two backends
implement it: ``kvstore.index_memory.MemoryIndex`` (embedded in the Conductor) and
``kvstore.index_redis.RedisIndex`` (shared by several Conductors); ``FallbackIndex`` in
``kvstore.index_fallback`` answers from a local ``MemoryIndex`` while Redis is unreachable.

Semantics shared by every backend (the contract tests in ``tests/kvstore/test_index.py``):

- A worker holds a block at one tier at a time; a ``STORED`` event sets (or moves) it, a
  ``REMOVED`` event drops it. Events from a worker that is not alive are ignored: its blocks
  would never be offered, and ignoring them keeps a dead worker from leaking index entries.
- A worker is alive from ``register`` until ``remove`` or until ``ttl_s`` passes without a
  ``heartbeat``. An expired worker vanishes from ``workers()`` and ``match()`` at once; its
  entries are purged by ``reap_expired()`` or when the same worker id registers again (a new
  incarnation republishes what it still holds).
- ``match(keys)`` reports, per alive worker, the contiguous held prefix of ``keys`` and the
  usable prefix under the hybrid hit rule (DESIGN.md section 3): the deepest ``i`` such that
  the worker holds ``keys[0:i]`` and ``keys[i-1]`` carries a KDA snapshot on that worker.

    keys:        k0    k1    k2    k3    k4
    held by w:   DRAM  DEV   DRAM  SSD   -      -> num_blocks_present = 4
    snapshot:    no    yes   no    no           -> num_blocks_usable  = 2 (prefix k0..k1)
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Sequence

from kvstore.blocks import KEY_BYTES, BlockKey, Tier

_SLOWEST_FIRST = tuple((t, int(t)) for t in sorted(Tier, reverse=True))


class IndexUnavailable(RuntimeError):
    """The index backend (Redis) cannot be reached within the retry budget."""

    def __init__(self, url: str, cause: BaseException) -> None:
        super().__init__(f"global index at {url} is unavailable: {type(cause).__name__}: {cause}")
        self.url = url
        self.cause = cause


class BlockEventKind(enum.StrEnum):
    STORED = "stored"
    REMOVED = "removed"


class WorkerRole(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


def check_key(key: BlockKey) -> None:
    """Raise ``ValueError`` unless ``key`` is a ``KEY_BYTES``-long ``bytes``."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"block key must be {KEY_BYTES} bytes, got {key!r}")


def check_keys(keys: Sequence[BlockKey]) -> None:
    """``check_key`` of every key; the common case (all valid) runs in C."""
    if set(map(type, keys)) - {bytes} or set(map(len, keys)) - {KEY_BYTES}:
        for key in keys:
            check_key(key)  # raises, naming the bad key


@dataclasses.dataclass(frozen=True, slots=True)
class BlockEvent:
    """One change of one worker's holding of one block; ``tier`` is None exactly when removed."""

    worker_id: str
    key: BlockKey
    tier: Tier | None
    has_snapshot: bool
    kind: BlockEventKind

    def __post_init__(self) -> None:
        check_key(self.key)
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")
        if (self.kind is BlockEventKind.STORED) != (self.tier is not None):
            raise ValueError(f"a {self.kind} event needs tier {'set' if self.tier is None else 'None'}")
        if self.kind is BlockEventKind.REMOVED and self.has_snapshot:
            raise ValueError("a removed event carries no snapshot")

    @classmethod
    def stored(cls, worker_id: str, key: BlockKey, tier: Tier, has_snapshot: bool = False) -> BlockEvent:
        return cls(worker_id, key, Tier(tier), has_snapshot, BlockEventKind.STORED)

    @classmethod
    def removed(cls, worker_id: str, key: BlockKey) -> BlockEvent:
        return cls(worker_id, key, None, False, BlockEventKind.REMOVED)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Static facts about a worker, given at registration."""

    worker_id: str
    role: WorkerRole
    address: str
    num_pages_total: int
    dram_capacity_bytes: int
    ssd_capacity_bytes: int

    def __post_init__(self) -> None:
        if not self.worker_id or ":" in self.worker_id:
            raise ValueError(f"worker_id must be non-empty and contain no ':', got {self.worker_id!r}")
        for name in ("num_pages_total", "dram_capacity_bytes", "ssd_capacity_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillJobLoad:
    """One prefill a worker holds: queued (``elapsed_s == 0``) or running."""

    request_id: str
    num_new_tokens: int
    num_reused_tokens: int = 0
    elapsed_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_new_tokens < 0 or self.num_reused_tokens < 0 or self.elapsed_s < 0:
            raise ValueError(f"prefill job {self.request_id!r}: negative count in {self}")


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load as of ``timestamp_s`` (the worker's wall clock, seconds since the epoch).

    The one load value from the wire (``proto.convert.load_from_proto``) through the index to
    the routing snapshot. Prefill workers fill ``prefill_jobs`` (queued and running prefills);
    decode workers fill ``num_queued`` (reserved, not yet decoding), ``num_running``,
    ``num_context_tokens`` and ``request_ids`` (every request holding pages).
    """

    num_queued: int = 0
    num_running: int = 0
    num_free_pages: int = 0
    num_context_tokens: int = 0
    prefill_jobs: tuple[PrefillJobLoad, ...] = ()
    request_ids: tuple[str, ...] = ()
    timestamp_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_queued", "num_running", "num_free_pages", "num_context_tokens", "timestamp_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def initial(cls, info: WorkerInfo) -> WorkerLoad:
        """Load assumed between registration and the first heartbeat: idle, everything free."""
        return cls(num_free_pages=info.num_pages_total)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> WorkerLoad:
        """Inverse of ``to_dict`` (JSON in the Redis index)."""
        jobs = tuple(PrefillJobLoad(**j) for j in fields.get("prefill_jobs", ()))
        return cls(**{**fields, "prefill_jobs": jobs, "request_ids": tuple(fields.get("request_ids", ()))})


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerMatch:
    """How much of a key sequence one worker holds. ``tiers[i]`` is the ``Tier`` value of
    ``keys[i]`` as one byte (a 1,000-block match is one ``bytes``, not 1,000 objects); any
    sequence of tiers given is stored that way, so ``WorkerMatch(w, 2, 2, (DRAM, SSD))`` equals
    the index's answer and ``tiers[i] == Tier.SSD`` holds (``Tier`` is an ``IntEnum``)."""

    worker_id: str
    num_blocks_present: int
    num_blocks_usable: int
    tiers: bytes

    def __post_init__(self) -> None:
        if type(self.tiers) is not bytes:
            object.__setattr__(self, "tiers", bytes(self.tiers))
        assert 0 <= self.num_blocks_usable <= self.num_blocks_present == len(self.tiers), self

    @property
    def slowest_usable_tier(self) -> Tier | None:
        """The slowest tier within the usable prefix, or None when nothing is usable."""
        for tier, value in _SLOWEST_FIRST:
            if self.tiers.find(value, 0, self.num_blocks_usable) >= 0:
                return tier
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class MatchSnapshot:
    """Per alive worker (sorted by id, zero matches included), the match of ``num_keys`` keys."""

    num_keys: int
    matches: tuple[WorkerMatch, ...]

    def get(self, worker_id: str) -> WorkerMatch | None:
        """The match of ``worker_id``, or None when that worker is not alive."""
        return next((m for m in self.matches if m.worker_id == worker_id), None)

    @property
    def best_usable(self) -> WorkerMatch | None:
        """The worker with the longest usable prefix (ties: lowest id), or None if none is usable."""
        best = max(self.matches, key=lambda m: m.num_blocks_usable, default=None)
        return best if best is not None and best.num_blocks_usable > 0 else None


class GlobalIndex(abc.ABC):
    """Block holdings and worker registry. Every method is thread-safe.

    Backends that talk to a server raise ``IndexUnavailable`` from any method when it cannot
    be reached; they never block longer than their configured retry budget.
    """

    @abc.abstractmethod
    def apply(self, events: Sequence[BlockEvent]) -> int:
        """Apply events in order; return how many were applied (events of dead workers are not)."""

    @abc.abstractmethod
    def match(self, keys: Sequence[BlockKey]) -> MatchSnapshot:
        """Prefix match of ``keys`` against every alive worker. No side effects."""

    @abc.abstractmethod
    def register(self, worker: WorkerInfo) -> bool:
        """Register or refresh a worker (counts as a heartbeat).

        Returns True for a new incarnation (the id was not alive): its stale blocks are dropped
        and its load starts at ``WorkerLoad.initial``. An alive worker keeps blocks and load.
        """

    @abc.abstractmethod
    def heartbeat(self, worker_id: str, load: WorkerLoad) -> bool:
        """Record ``load`` and extend the worker's lease by ``ttl_s``.

        Returns False when the worker is not alive (expired or unknown): it must register again.
        """

    @abc.abstractmethod
    def workers(self) -> list[tuple[WorkerInfo, WorkerLoad]]:
        """Alive workers with their latest load, sorted by worker id. No side effects."""

    @abc.abstractmethod
    def remove(self, worker_id: str) -> bool:
        """Forget a worker and all its blocks; return whether it was known."""

    @abc.abstractmethod
    def reap_expired(self) -> tuple[str, ...]:
        """Purge workers whose lease ran out, with their blocks; return their ids."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for in-process backends
        """Release connections; the index must not be used afterwards."""
