"""The decode worker's Prometheus metrics: step time and batch size per step, tokens
generated, reservations freed without a Decode call (``reason``: ``expired``, its TTL passed;
``transfer_failed``, its KV transfer failed, e.g. the prefill worker's ABORT for a Conductor
that died), and scrape-time gauges of the scheduler (running, queued, free and total pages).

``DecodeMetrics(identity)`` is handed to ``DecodeScheduler`` (``metrics=``), which calls
``step`` once per decode step from its loop thread and registers itself with ``watch`` so the
gauges are read from ``DecodeScheduler.load()`` only when Prometheus scrapes. Labels:
``worker_id``, ``role``, ``model`` (``runtime.metrics.Identity``). A disabled instance
(``DecodeMetrics.disabled()``) records nothing. Thread-safe.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from runtime.metrics import (
    BATCH_BUCKETS,
    IDENTITY_LABELS,
    STEP_BUCKETS,
    Identity,
    family,
    identity_gauges,
    scrape_collector,
    weak_source,
)

FREED_REASONS = ("expired", "transfer_failed")


class DecodeMetrics:
    def __init__(self, identity: Identity | None, registry: CollectorRegistry | None = None):
        """``identity`` None: disabled."""
        self.identity, self.registry = identity, registry
        self.enabled = identity is not None
        if identity is None:
            return
        labels = identity.labels
        self._step_s = family(registry, Histogram, "decode_step_seconds", "One decode step (model + sampling)",
                              IDENTITY_LABELS, buckets=STEP_BUCKETS).labels(**labels)
        self._batch = family(registry, Histogram, "decode_batch_size", "Requests in one decode step", IDENTITY_LABELS,
                             buckets=BATCH_BUCKETS).labels(**labels)
        self._tokens = family(registry, Counter, "decode_generated_tokens", "Tokens produced by decode steps",
                              IDENTITY_LABELS).labels(**labels)
        freed = family(registry, Counter, "decode_reservations_freed",
                       "Reservations freed without a Decode call: expired (TTL) or transfer_failed",
                       (*IDENTITY_LABELS, "reason"))
        self._freed = {reason: freed.labels(**labels, reason=reason) for reason in FREED_REASONS}

    @classmethod
    def disabled(cls) -> DecodeMetrics:
        return cls(None)

    def step(self, batch_size: int, step_s: float) -> None:
        """One decode step of ``batch_size`` requests took ``step_s`` seconds (one token each)."""
        if self.enabled:
            self._step_s.observe(step_s)
            self._batch.observe(batch_size)
            self._tokens.inc(batch_size)

    def reservation_freed(self, reason: str) -> None:
        """A reservation left without its Decode call, for ``reason`` (``FREED_REASONS``)."""
        if self.enabled:
            self._freed[reason].inc()

    def watch(self, scheduler: Any) -> None:
        """Read ``scheduler.load()`` and its page pool at every scrape (held weakly)."""
        if self.enabled:
            scrape_collector(self.registry, "decode").add(self.identity, weak_source(scheduler, self._gauges))

    def _gauges(self, scheduler: Any) -> list[Any]:
        assert self.identity is not None
        load = scheduler.load()
        values = (
            ("decode_running_requests", "Requests in the running batch", load.num_running),
            ("decode_queued_requests", "Requests reserved or waiting to join the batch", load.num_queued),
            ("decode_free_pages", "Free KV cache pages", load.num_free_pages),
            ("decode_total_pages", "KV cache pages in the pool", scheduler.cache.pool.num_pages),
            ("decode_context_tokens", "Tokens held by running requests", load.num_context_tokens),
        )
        return identity_gauges(self.identity, values)
