"""The tiered block store: one worker's cached blocks across device, DRAM and SSD.

Owns which tier holds each block, pin counts, and applying eviction. Each key lives in
exactly one tier. A put lands in the requested tier (or, when that is full of pinned
blocks, the next slower one); making room asks that tier's eviction policy for victims and
demotes them device -> DRAM -> SSD -> dropped; a hit in a slower tier promotes the block to
``StoreConfig.promote_to``. Pinned blocks stay where they are: never evicted, demoted,
promoted or replaced.

The device tier is the prefill worker's engine page pool (``kvstore.device``): a finished
prefill's blocks are adopted in the pages they were computed in (``adopt``), a later request
pins and shares them in place (``pin_device_prefix``), and unpinned ones are demoted when the
engine needs pages (``free_device_pages``).

Locking: one ``threading.Lock`` guards every public method, tier I/O included (so a slow
SSD write delays other callers). ``on_event`` callbacks run under that lock, in the order
the changes happen; a callback must be quick (enqueue) and must not call the store.

Corruption: every SSD read is verified; a block that fails is dropped (a "removed" event)
and reads as a miss, so callers recompute it.

Metrics (``kvstore.metrics.StoreMetrics``, optional): lookups by tier and misses here,
evictions, demotions and promotions in ``Placement``, SSD blocks found corrupt (the SSD
tier reports them); the gauges read ``tier_usage()``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence

from kvstore.blocks import KEY_BYTES, BlockKey, Tier
from kvstore.device import DeviceTier, Snapshot
from kvstore.dram import DramTier
from kvstore.eviction import DEFAULT_POLICY, POLICIES
from kvstore.hitrule import SnapshotPolicy
from kvstore.metrics import StoreMetrics
from kvstore.payload import BlockPayload
from kvstore.payload_format import verify
from kvstore.placement import Backend, Placement, StoreEvent, as_bytes, as_payload
from kvstore.ssd import SsdTier

__all__ = ["StoreConfig", "StoreEvent", "TieredStore"]


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """One store's settings. Capacities in bytes; a host tier with capacity 0 is absent; the
    device tier is configured by handing the store a ``DeviceTier`` (the engine's page pool).

    ``eviction_policy``: a name in ``eviction.POLICIES``, one instance per tier.
    ``snapshot_interval_blocks``: KDA snapshot spacing (``snapshot_policy``), for the
    workers that decide which blocks carry snapshots. ``promote_to``: a hit in a slower tier
    moves the block up to the fastest configured tier no faster than this one.
    ``ssd_fsync``: False skips fsyncs (still atomic against a killed process, not against
    power loss); for benchmarks and tests.
    """

    model_fingerprint: str
    dram_capacity_bytes: int = 1 << 30
    ssd_capacity_bytes: int = 0
    ssd_dir: str | None = None
    eviction_policy: str = DEFAULT_POLICY
    snapshot_interval_blocks: int = 8
    promote_to: Tier = Tier.DRAM
    ssd_fsync: bool = True

    def __post_init__(self) -> None:
        if self.dram_capacity_bytes < 0 or self.ssd_capacity_bytes < 0:
            raise ValueError(f"capacities must be >= 0: dram {self.dram_capacity_bytes}, ssd {self.ssd_capacity_bytes}")
        if self.ssd_capacity_bytes and not self.ssd_dir:
            raise ValueError("ssd_capacity_bytes > 0 needs ssd_dir")
        if self.eviction_policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {self.eviction_policy!r}; registered: {sorted(POLICIES)}")
        SnapshotPolicy(self.snapshot_interval_blocks)

    @property
    def snapshot_policy(self) -> SnapshotPolicy:
        return SnapshotPolicy(self.snapshot_interval_blocks)


class TieredStore:
    """Blocks by key across tiers; see the module docstring for placement and locking."""

    def __init__(
        self,
        config: StoreConfig,
        *,
        device: DeviceTier | None = None,
        on_event: Callable[[StoreEvent], None] | None = None,
        metrics: StoreMetrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or StoreMetrics.disabled()
        self._lock = threading.Lock()
        tiers: dict[Tier, Backend] = {}
        if device is not None:
            if device.model_fingerprint != config.model_fingerprint:
                raise ValueError(
                    f"device tier is for {device.model_fingerprint!r}, store for {config.model_fingerprint!r}"
                )
            tiers[Tier.DEVICE] = device
        if config.dram_capacity_bytes:
            tiers[Tier.DRAM] = DramTier(config.dram_capacity_bytes)
        if config.ssd_capacity_bytes:
            assert config.ssd_dir is not None
            tiers[Tier.SSD] = SsdTier(
                config.ssd_dir, config.ssd_capacity_bytes, config.model_fingerprint, config.ssd_fsync,
                on_corrupt=lambda key: self.metrics.corrupt_on_ssd(),
            )
        if not tiers:
            raise ValueError("a store needs at least one tier: give DRAM or SSD capacity, or a device tier")
        self._placement = Placement(tiers, config.eviction_policy, config.promote_to, on_event, self.metrics)
        self._placement.republish_ssd()
        self.metrics.watch(self)

    def close(self) -> None:
        """Release file handles; SSD blocks stay on disk for the next store."""
        with self._lock:
            ssd = self._placement.tiers.get(Tier.SSD)
            if isinstance(ssd, SsdTier):
                ssd.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- queries ---------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """Configured tiers, fastest first."""
        return tuple(self._placement.tiers)

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._placement.where

    def tier_of(self, key: BlockKey) -> Tier | None:
        with self._lock:
            return self._placement.where.get(key)

    def has_snapshot(self, key: BlockKey) -> bool:
        with self._lock:
            return self._placement.has_snapshot(key)

    def pin_count(self, key: BlockKey) -> int:
        with self._lock:
            return self._placement.pins.get(key, 0)

    def used_bytes(self, tier: Tier) -> int:
        with self._lock:
            return self._backend(tier).ledger.used_bytes

    def capacity_bytes(self, tier: Tier) -> int:
        return self._backend(tier).ledger.capacity_bytes

    def tier_usage(self) -> dict[Tier, tuple[int, int, int]]:
        """(used bytes, capacity bytes, blocks) per configured tier, in one consistent look."""
        with self._lock:
            return {t: (b.ledger.used_bytes, b.ledger.capacity_bytes, len(b.ledger.sizes_bytes))
                    for t, b in self._placement.tiers.items()}

    def keys(self, tier: Tier) -> list[BlockKey]:
        with self._lock:
            return list(self._backend(tier).ledger.sizes_bytes)

    def page_of(self, key: BlockKey) -> int | None:
        """The device page holding ``key`` (None unless it is in the device tier); pin the
        key for as long as the page is read (``pin_device_prefix`` does both)."""
        with self._lock:
            device = self._placement.tiers.get(Tier.DEVICE)
            return device.page_of(key) if isinstance(device, DeviceTier) else None

    def pin_device_prefix(self, keys: Sequence[BlockKey]) -> list[tuple[int, Snapshot | None]]:
        """Pin the leading run of ``keys`` held in the device tier and return each one's
        (page, KDA snapshot or None), to be reused in place; unpin the keys when done."""
        with self._lock:
            device = self._placement.tiers.get(Tier.DEVICE)
            if not isinstance(device, DeviceTier):
                return []
            out: list[tuple[int, Snapshot | None]] = []
            for key in keys:
                page = device.page_of(key)
                if page is None:
                    break
                self._placement.pin(key)
                self._placement.policies[Tier.DEVICE].on_access(key)
                self.metrics.lookup(Tier.DEVICE)
                out.append((page, device.snapshot_of(key)))
            return out

    def adopt(self, key: BlockKey, page: int, snapshot: Snapshot | None) -> bool:
        """Keep block ``key`` in the device tier as the page a request computed it in (no
        copy; ``DeviceTier.adopt``), moving it up from a slower tier if it is there. False
        when there is no device tier, the key is pinned elsewhere, or no room can be made."""
        self._check_key(key)
        with self._lock:
            if Tier.DEVICE not in self._placement.tiers:
                return False
            return self._placement.adopt(key, page, snapshot)

    def free_device_pages(self, num_pages: int) -> bool:
        """Demote unpinned device blocks until the engine's pool has ``num_pages`` free pages
        (the prefill worker calls it when a request's pages do not fit). False when it cannot."""
        with self._lock:
            return self._placement.free_device_pages(num_pages)

    def num_evictable_device_blocks(self) -> int:
        """Device-tier blocks that are not pinned (their pages can be freed on demand)."""
        with self._lock:
            device = self._placement.tiers.get(Tier.DEVICE)
            if not isinstance(device, DeviceTier):
                return 0
            pinned = sum(1 for key in self._placement.pins if self._placement.where.get(key) == Tier.DEVICE)
            return len(device.ledger.sizes_bytes) - pinned

    def device_pages(self) -> list[int]:
        """The pool pages the device tier holds (for ``CacheManager.check_integrity``)."""
        with self._lock:
            device = self._placement.tiers.get(Tier.DEVICE)
            return device.held_pages() if isinstance(device, DeviceTier) else []

    # ----- puts and gets ---------------------------------------------------------------

    def put(self, key: BlockKey, payload: BlockPayload, tier: Tier = Tier.DRAM) -> bool:
        """Store a block at ``tier`` (or a slower one when that is full of pinned blocks),
        evicting as needed. A present key is only touched, unless ``payload`` adds a KDA
        snapshot it lacks, which replaces it. Returns False when it fits nowhere (or is
        pinned and would need replacing). ValueError for a foreign model or bad key."""
        self._check_key(key)
        if payload.model_fingerprint != self.config.model_fingerprint:
            raise ValueError(
                f"payload is for {payload.model_fingerprint!r}, store for {self.config.model_fingerprint!r}"
            )
        device = self._placement.tiers.get(Tier.DEVICE)
        if isinstance(device, DeviceTier):
            device.check_payload(payload)
        with self._lock:
            return self._placement.put(key, payload, payload.has_snapshot, self._backend(tier).tier)

    def put_encoded(self, key: BlockKey, encoded: bytes, tier: Tier = Tier.DRAM) -> bool:
        """``put`` for a block already encoded (e.g. received from a peer): verified first
        (``PayloadError`` when corrupt or for another model), stored without re-encoding."""
        self._check_key(key)
        head = verify(encoded, self.config.model_fingerprint)
        with self._lock:
            return self._placement.put(key, bytes(encoded), head.has_snapshot, self._backend(tier).tier)

    def try_get(self, key: BlockKey) -> BlockPayload | None:
        """The block (tensors owned by the caller), or None when absent or found corrupt on
        SSD: then its file is deleted, the block dropped everywhere (a "removed" event, so
        the global index forgets it), counted (``kv_corruption_total{where="ssd"}``) and
        logged; the caller recomputes it. A hit counts as an access and promotes an unpinned
        block found below ``config.promote_to`` (when room can be made there)."""
        with self._lock:
            blob = self._lookup(key)
            return None if blob is None else as_payload(blob)

    def try_get_encoded(self, key: BlockKey) -> bytes | None:
        """The block's encoded bytes (to send to a peer), or None; same effects as try_get."""
        with self._lock:
            blob = self._lookup(key)
            return None if blob is None else as_bytes(blob)

    def remove(self, key: BlockKey) -> bool:
        """Drop a block. False when it is absent or pinned."""
        with self._lock:
            if key not in self._placement.where or key in self._placement.pins:
                return False
            self._placement.drop(key)
            return True

    # ----- pins ------------------------------------------------------------------------

    def pin(self, keys: Iterable[BlockKey]) -> bool:
        """Pin every key (counted: each pin needs an unpin), or none and return False when
        one is absent. Pinned blocks are never evicted, demoted or replaced."""
        keys = list(keys)
        with self._lock:
            if any(key not in self._placement.where for key in keys):
                return False
            for key in keys:
                self._placement.pin(key)
            return True

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        """Undo one ``pin`` of each key; ValueError (and no change) when one is not pinned."""
        keys = list(keys)
        with self._lock:
            wanted: dict[BlockKey, int] = {}
            for key in keys:
                wanted[key] = wanted.get(key, 0) + 1
            for key, n in wanted.items():
                pinned = self._placement.pins.get(key, 0)
                if pinned < n:
                    raise ValueError(f"unpin {key.hex()} x{n} but it is pinned {pinned} times")
            for key in keys:
                self._placement.unpin(key)

    # ----- integrity -------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError when an invariant is broken (``Placement.check_integrity``)."""
        with self._lock:
            self._placement.check_integrity()

    # ----- helpers ---------------------------------------------------------------------

    def _lookup(self, key: BlockKey):
        """``Placement.get`` counted as a hit (by the tier it was in) or a miss. Under the lock."""
        tier = self._placement.where.get(key)
        blob = self._placement.get(key)
        self.metrics.lookup(tier if blob is not None else None)
        return blob

    def _backend(self, tier: Tier) -> Backend:
        if tier not in self._placement.tiers:
            raise ValueError(f"tier {tier.name} is not configured; this store has {[t.name for t in self.tiers]}")
        return self._placement.tiers[tier]

    @staticmethod
    def _check_key(key: BlockKey) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"block keys are {KEY_BYTES} bytes, got {len(key)}")
