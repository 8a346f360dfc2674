"""Block placement across one worker's tiers: the mechanism under ``TieredStore``.

Owns the tier backends, one eviction policy instance per tier, which tier holds each key
(each key lives in exactly one), and pin counts. Applies puts, adoptions of a request's page
into the device tier, gets with promotion, eviction with demotion (device -> DRAM -> SSD ->
dropped; also to free engine pages, ``free_device_pages``) and drops, and reports every change through
the event callback, in order. Victims come from the tier's policy (a pure choice); nothing
is evicted unless the choice frees enough. Not thread-safe: ``TieredStore`` calls it under
its lock. Moves are counted in an optional ``StoreMetrics`` (evictions, demotions, promotions).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal, NamedTuple

from kvstore.blocks import BlockKey, Tier
from kvstore.device import DeviceTier
from kvstore.dram import DramTier
from kvstore.eviction import EvictionPolicy, EvictionView, make_policy
from kvstore.metrics import StoreMetrics
from kvstore.payload import BlockPayload
from kvstore.payload_format import decode, encode, encode_parts
from kvstore.sized import SizedBlob, SizedTier
from kvstore.ssd import SsdTier

logger = logging.getLogger(__name__)

EventKind = Literal["stored", "moved", "removed"]
Blob = BlockPayload | bytes | bytearray | SizedBlob  # a payload, its encoded bytes, or (simulator) its size
Backend = DeviceTier | DramTier | SsdTier | SizedTier


class StoreEvent(NamedTuple):
    """A change to the store, for a worker to publish to the global index ("stored" and
    "moved" map to ``index.BlockEvent.stored``, "removed" to ``BlockEvent.removed``).
    ``tier``: where the block is now (for "removed": where it was). ``has_snapshot``:
    whether it carries a KDA snapshot. A named tuple (immutable like a frozen dataclass, made
    in a fraction of its time: one per block stored, moved or dropped)."""

    kind: EventKind
    key: BlockKey
    tier: Tier
    has_snapshot: bool


class Placement:
    """Tiers (fastest first), their policies, key locations and pins; see the module docstring.

    ``promote_to``: a hit moves the block up to the fastest tier no faster than this one.
    """

    def __init__(
        self,
        tiers: dict[Tier, Backend],
        policy_name: str,
        promote_to: Tier,
        on_event: Callable[[StoreEvent], None] | None,
        metrics: StoreMetrics | None = None,
    ) -> None:
        self.tiers = dict(sorted(tiers.items()))
        self.metrics = metrics or StoreMetrics.disabled()
        self.policies: dict[Tier, EvictionPolicy] = {t: make_policy(policy_name) for t in self.tiers}
        self.promote_to = promote_to
        self.where: dict[BlockKey, Tier] = {}
        self.pins: dict[BlockKey, int] = {}
        self._emit_event = on_event
        # Per tier, made once: the slower tiers (demotion targets, fastest first) and the live
        # eviction view (the ledger's size map and the pins' key view follow every change).
        self._slower = {t: tuple(s for s in self.tiers if s > t) for t in self.tiers}
        self._views = {t: EvictionView(b.ledger.sizes_bytes, self.pins.keys()) for t, b in self.tiers.items()}
        self._hit_target = next((t for t in self.tiers if t >= promote_to), None)  # where a hit moves up to
        self._ledgers = {t: b.ledger for t, b in self.tiers.items()}
        self._sized = {t for t, b in self.tiers.items() if isinstance(b, SizedTier)}  # the simulator's tiers

    def republish_ssd(self) -> None:
        """Adopt the valid blocks an SSD rescan finds (at startup), emitting "stored" for each."""
        ssd = self.tiers.get(Tier.SSD)
        if not isinstance(ssd, SsdTier):
            return
        for key in ssd.rescan():
            self.where[key] = Tier.SSD
            self.policies[Tier.SSD].on_insert(key)
            self._emit("stored", key, Tier.SSD)

    def has_snapshot(self, key: BlockKey) -> bool:
        tier = self.where.get(key)
        return tier is not None and self.tiers[tier].ledger.has_snapshot(key)

    def pin(self, key: BlockKey) -> None:
        self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, key: BlockKey) -> None:
        if self.pins[key] == 1:
            del self.pins[key]
        else:
            self.pins[key] -= 1

    def check_integrity(self) -> None:
        """Raise AssertionError when an invariant is broken: per-tier byte accounting and
        capacity, each key in exactly one tier, policies tracking exactly their tier's keys,
        pin counts positive."""
        seen: dict[BlockKey, Tier] = {}
        for tier, backend in self.tiers.items():
            backend.check_integrity()
            keys = set(backend.ledger.sizes_bytes)
            if self.policies[tier].tracked() != keys:
                raise AssertionError(f"{tier.name}: policy tracks other keys than the tier holds")
            for key in keys:
                if key in seen:
                    raise AssertionError(f"{key.hex()} is in {seen[key].name} and {tier.name}")
                seen[key] = tier
        if seen != self.where:
            raise AssertionError("the key -> tier map disagrees with the tiers")
        if any(n <= 0 for n in self.pins.values()):
            raise AssertionError(f"non-positive pin counts: {self.pins}")

    def _emit(self, kind: EventKind, key: BlockKey, tier: Tier, has_snapshot: bool | None = None) -> None:
        if self._emit_event is None:
            return
        if has_snapshot is None:
            has_snapshot = self.tiers[tier].ledger.has_snapshot(key)
        self._emit_event(StoreEvent(kind, key, tier, has_snapshot))

    def put(self, key: BlockKey, blob: Blob, has_snapshot: bool, tier: Tier) -> bool:
        """Place a block at ``tier`` or the first slower tier that takes it; a present key is
        only touched unless the new block adds a snapshot (then replaced, unless pinned).
        False when it fits nowhere."""
        current = self.where.get(key)
        if current is not None:
            if not has_snapshot or self.tiers[current].ledger.has_snapshot(key):
                self.policies[current].on_access(key)
                return True
            if key in self.pins:
                return False
            self._detach(key, current)
        for target in self.tiers:
            if target >= tier and self._insert(key, blob, target):
                self.where[key] = target
                self._emit("stored", key, target)
                return True
        if current is not None:  # the old copy is gone and the new one fits nowhere
            del self.where[key]
            self._emit("removed", key, current, has_snapshot=False)
        return False

    def adopt(self, key: BlockKey, page: int, snapshot) -> bool:
        """Hold a request's ``page`` as block ``key`` in the device tier (``DeviceTier.adopt``),
        moving the block up from a slower tier when it is there. A block already on the device
        is only touched unless this adds a snapshot. False (nothing changed) when the key is
        pinned elsewhere or the device tier cannot make room."""
        device = self.tiers.get(Tier.DEVICE)
        assert isinstance(device, DeviceTier), "adopt needs a device tier"
        current = self.where.get(key)
        if current is not None:
            if snapshot is None and (current == Tier.DEVICE or self.tiers[current].ledger.has_snapshot(key)):
                self.policies[current].on_access(key)
                return True
            if key in self.pins:
                return False
        size_bytes = device.snapshot_size(snapshot)
        if current == Tier.DEVICE:  # replaced by the copy with a snapshot
            self._detach(key, current)
            del self.where[key]
            self._emit("removed", key, current, has_snapshot=False)
            current = None
        self.pin(key)  # the demotions that make room must not move this block's slower copy
        try:
            room = self._make_room(Tier.DEVICE, size_bytes)
        finally:
            self.unpin(key)
        if not room:
            return False
        if current is not None:
            self._detach(key, current)
            self.metrics.promoted(current)
        device.adopt(key, page, snapshot)
        self.policies[Tier.DEVICE].on_insert(key)
        self.where[key] = Tier.DEVICE
        self._emit("moved" if current is not None else "stored", key, Tier.DEVICE)
        return True

    def free_device_pages(self, num_pages: int) -> bool:
        """Evict (demote) unpinned device blocks until the pool has ``num_pages`` free pages;
        False when it cannot (the rest are pinned or held by running requests)."""
        device = self.tiers.get(Tier.DEVICE)
        if not isinstance(device, DeviceTier):
            return False
        while device.num_free_pages < num_pages:
            victims = self.policies[Tier.DEVICE].select_victims(self._views[Tier.DEVICE], 1)
            if not victims:
                return False
            self.metrics.evicted(Tier.DEVICE)
            self._demote(victims[0], Tier.DEVICE)
        return True

    def get(self, key: BlockKey) -> Blob | None:
        """The block as its tier holds it (a device payload copy, DRAM bytes, or a verified
        SSD buffer), counting the access and promoting an unpinned block; None when absent
        or dropped as corrupt."""
        tier = self.where.get(key)
        if tier is None:
            return None
        backend = self.tiers[tier]
        has_snapshot = backend.ledger.has_snapshot(key)  # the tier forgets it if the read fails
        blob = backend.try_get(key)
        if blob is None:  # failed verification on SSD; the tier has deleted it
            self.drop(key, has_snapshot)
            return None
        self.policies[tier].on_access(key)
        target = self._promotion_target(tier)
        if target is not None and key not in self.pins:
            self._promote(key, blob, tier, target)
        return blob

    def _promotion_target(self, tier: Tier) -> Tier | None:
        target = self._hit_target
        return target if target is not None and target < tier else None

    def _promote(self, key: BlockKey, blob: Blob, source: Tier, target: Tier) -> None:
        # Leave `source` first, so the room this frees can take blocks that making room in
        # `target` demotes. `blob` holds the data meanwhile. When `target` refuses, the
        # block goes back to `source` (or, if that has filled up with pinned blocks, is lost).
        has_snapshot = self.tiers[source].ledger.has_snapshot(key)
        self._detach(key, source)
        if self._insert(key, blob, target):
            self.where[key] = target
            self.metrics.promoted(source)
            self._emit("moved", key, target)
        elif not self._insert(key, blob, source):
            del self.where[key]
            self._emit("removed", key, source, has_snapshot)

    def _insert(self, key: BlockKey, blob: Blob, tier: Tier) -> bool:
        """Place a block into ``tier`` (where it is not yet), making room; False if it cannot."""
        backend = self.tiers[tier]
        if tier in self._sized:
            assert isinstance(blob, SizedBlob), f"a sized tier holds sizes, not {type(blob).__name__}"
            if not self._make_room(tier, blob.size_bytes):
                return False
            backend.put(key, blob)
        elif isinstance(backend, DeviceTier):
            payload = as_payload(blob)
            if not self._make_room(tier, backend.size_for(payload)):
                return False
            while not backend.put(key, payload):  # the engine holds the other pages
                if not self._make_room(tier, backend.ledger.free_bytes + 1):
                    return False
        elif isinstance(backend, DramTier):
            data = as_bytes(blob)
            if not self._make_room(tier, len(data)):
                return False
            backend.put(key, data)
        else:
            parts = encode_parts(blob) if isinstance(blob, BlockPayload) else [blob]
            size_bytes = sum(memoryview(p).nbytes for p in parts)
            if not self._make_room(tier, size_bytes) or not backend.put(key, parts):
                return False
        self.policies[tier].on_insert(key)
        return True

    def _make_room(self, tier: Tier, need_bytes: int) -> bool:
        """Evict from ``tier`` until ``need_bytes`` fit; evicts nothing when that is impossible.

        Each victim is demoted (``_demote``) before the next is taken, and a demotion makes
        room in the slower tier the same way, so one insert into full tiers runs at most one
        level deep per slower tier (device -> DRAM -> SSD -> dropped) and its events come out
        deepest first: the SSD's victim removed, DRAM's moved down, the device's moved down,
        then the new block stored. The victims are chosen once, from a view kept per tier."""
        ledger = self._ledgers[tier]
        deficit = need_bytes - (ledger.capacity_bytes - ledger.used_bytes)  # ledger.free_bytes
        if deficit <= 0:
            return True
        if need_bytes > ledger.capacity_bytes:
            return False
        victims = self.policies[tier].select_victims(self._views[tier], deficit)
        sizes, pins = ledger.sizes_bytes, self.pins
        freed_bytes = 0
        for victim in victims:
            if victim not in sizes or victim in pins:
                raise AssertionError(f"{tier.name}: policy chose a pinned or absent victim")
            freed_bytes += sizes[victim]
        if freed_bytes < deficit:
            return False
        metrics = self.metrics
        for victim in victims:
            if metrics.enabled:
                metrics.evicted(tier)
            self._demote(victim, tier)
        return True

    def _demote(self, key: BlockKey, tier: Tier) -> None:
        """Move an evicted block to the first slower tier that takes it, else drop it."""
        slower = self._slower[tier]
        blob = self.tiers[tier].try_get(key) if slower else None
        if blob is not None:
            for target in slower:
                if self._insert(key, blob, target):
                    self._detach(key, tier)
                    self.where[key] = target
                    if self.metrics.enabled:
                        self.metrics.demoted(tier)
                    if logger.isEnabledFor(logging.DEBUG):  # the names cost more than the move
                        logger.debug("demoted %s from %s to %s", key.hex(), tier.name, target.name)
                    self._emit("moved", key, target)
                    return
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("dropped %s from %s", key.hex(), tier.name)
        self.drop(key)

    def _detach(self, key: BlockKey, tier: Tier) -> None:
        """Remove a block from one tier's storage and policy (bookkeeping of _where aside)."""
        self.tiers[tier].remove(key)
        self.policies[tier].on_remove(key)

    def drop(self, key: BlockKey, has_snapshot: bool | None = None) -> None:
        """Forget a present block everywhere and emit "removed" (``has_snapshot``: what the
        block carried, when its tier has already forgotten it)."""
        tier = self.where.pop(key)
        if has_snapshot is None:
            has_snapshot = self.tiers[tier].ledger.has_snapshot(key)
        self._detach(key, tier)
        self._emit("removed", key, tier, has_snapshot)


def as_payload(blob: Blob) -> BlockPayload:
    # Encoded blobs in the store were verified on entry (put_encoded, SSD reads) or made by
    # encode(), so only the header is re-checked here.
    return blob if isinstance(blob, BlockPayload) else decode(blob, verify_checksum=False)


def as_bytes(blob: Blob) -> bytes:
    if isinstance(blob, BlockPayload):
        return encode(blob)
    return blob if isinstance(blob, bytes) else bytes(blob)
