"""The KV store's Prometheus metrics: hits and misses, evictions, demotions and promotions by
tier, blocks found corrupt, and scrape-time gauges of bytes, capacity and blocks per tier.

``StoreMetrics(identity)`` is handed to ``TieredStore`` (``metrics=``), which counts lookups
and passes it to its ``Placement`` for the moves. The ``tier`` label is the tier a block was
found in (hits) or leaves (evictions: made room in it; demotions: moved down out of it;
promotions: moved up out of it); misses have no tier. Labels also carry ``worker_id``,
``role``, ``model`` (``runtime.metrics.Identity``). A disabled instance records nothing.
Thread-safe; the gauges take the store's lock for a moment at each scrape.

``tidekv:kv_corruption_total{where}`` counts KV found corrupt and discarded: ``where="ssd"``
a block file that failed verification (here), ``where="transfer"`` a frame that failed its
checksum (``kvstore.transfer.metrics``); one family, defined once by ``corruption_counter``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from kvstore.blocks import Tier
from runtime.metrics import IDENTITY_LABELS, PREFIX, Identity, family, scrape_collector, weak_source

TIER_LABELS = {t: t.name.lower() for t in Tier}
CORRUPTION_WHERE = ("transfer", "ssd")


def corruption_counter(registry: CollectorRegistry | None, identity: Identity, where: str) -> Any:
    """The ``tidekv:kv_corruption_total`` child of ``identity`` for ``where`` (transfer | ssd)."""
    if where not in CORRUPTION_WHERE:
        raise ValueError(f"corruption where={where!r}, expected one of {CORRUPTION_WHERE}")
    fam = family(registry, Counter, "kv_corruption", "KV found corrupt (checksum mismatch) and discarded",
                 (*IDENTITY_LABELS, "where"))
    return fam.labels(**identity.labels, where=where)


class StoreMetrics:
    def __init__(self, identity: Identity | None, registry: CollectorRegistry | None = None):
        """``identity`` None: disabled."""
        self.identity, self.registry = identity, registry
        self.enabled = identity is not None
        if identity is None:
            return
        labels = identity.labels
        by_tier = (*IDENTITY_LABELS, "tier")

        def per_tier(name: str, doc: str) -> dict[Tier, Any]:
            fam = family(registry, Counter, name, doc, by_tier)
            return {t: fam.labels(**labels, tier=TIER_LABELS[t]) for t in Tier}

        self._hits = per_tier("kv_hits", "Block lookups answered, by the tier the block was in")
        self._evictions = per_tier("kv_evictions", "Blocks evicted to make room in a tier (demoted or dropped)")
        self._demotions = per_tier("kv_demotions", "Evicted blocks moved down to a slower tier, by the tier left")
        self._promotions = per_tier("kv_promotions", "Blocks moved up on a hit, by the tier left")
        self._misses = family(registry, Counter, "kv_misses", "Block lookups that found nothing",
                              IDENTITY_LABELS).labels(**labels)
        self._corrupt = corruption_counter(registry, identity, "ssd")

    @classmethod
    def disabled(cls) -> StoreMetrics:
        return cls(None)

    def lookup(self, tier: Tier | None) -> None:
        """A lookup found its block in ``tier`` (None: a miss)."""
        if self.enabled:
            (self._misses if tier is None else self._hits[tier]).inc()

    def corrupt_on_ssd(self) -> None:
        """A block file failed verification and was dropped."""
        if self.enabled:
            self._corrupt.inc()

    def evicted(self, tier: Tier) -> None:
        if self.enabled:
            self._evictions[tier].inc()

    def demoted(self, tier: Tier) -> None:
        if self.enabled:
            self._demotions[tier].inc()

    def promoted(self, tier: Tier) -> None:
        if self.enabled:
            self._promotions[tier].inc()

    def watch(self, store: Any) -> None:
        """Read ``store.tier_usage()`` at every scrape (held weakly)."""
        if self.enabled:
            scrape_collector(self.registry, "kvstore").add(self.identity, weak_source(store, self._gauges))

    def _gauges(self, store: Any) -> list[GaugeMetricFamily]:
        assert self.identity is not None
        names = (("kv_used_bytes", "Bytes of blocks held in a tier"),
                 ("kv_capacity_bytes", "Capacity of a tier in bytes"),
                 ("kv_blocks", "Blocks held in a tier"))
        fams = [GaugeMetricFamily(PREFIX + n, doc, labels=[*IDENTITY_LABELS, "tier"]) for n, doc in names]
        ident = [self.identity.worker_id, self.identity.role, self.identity.model]
        for tier, values in store.tier_usage().items():
            for fam, value in zip(fams, values, strict=True):
                fam.add_metric([*ident, TIER_LABELS[tier]], value)
        return fams
