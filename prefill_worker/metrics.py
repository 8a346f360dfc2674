"""The prefill worker's Prometheus metrics: tokens computed and reused (rate = tokens/s),
the duration of each prefill, of each stage of it (``STAGES``: where a cold TTFT goes), of
each chunk and of each layer, and scrape-time gauges of the runner (queued and running
prefills, free and total pages).

``PrefillMetrics(identity)`` is handed to ``PrefillRunner`` (``metrics=``); the runner calls
``prefilled`` once per prefill and times layers with a ``LayerTimer`` around its per-layer
push hook, and registers itself with ``watch``. Labels: ``worker_id``, ``role``, ``model``
(``runtime.metrics.Identity``), plus ``kind`` (``computed``/``reused`` tokens; ``kda``/``mla``
layers). A disabled instance (``PrefillMetrics.disabled()``) records nothing. Thread-safe; a
``LayerTimer`` belongs to one prefill.
"""

from __future__ import annotations

import time
from collections.abc import Container, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from runtime.metrics import (
    IDENTITY_LABELS,
    LAYER_BUCKETS,
    REQUEST_BUCKETS,
    STEP_BUCKETS,
    Identity,
    family,
    identity_gauges,
    scrape_collector,
    weak_source,
)

STAGES = ("queue", "reuse", "compute", "push", "verdict", "store")


class LayerTimer:
    """Times the layers and chunks of one prefill from its per-layer hook: ``layer_done`` at
    the hook's entry (the layer's compute just ended), ``resume`` at its exit (compute goes on).
    A chunk ends with its last layer; the push work in the hook is not counted as compute."""

    def __init__(self, metrics: PrefillMetrics, last_layer: int, mla_layers: Container[int]):
        self._metrics, self._last, self._mla = metrics, last_layer, mla_layers
        self._mark = self._chunk_mark = time.perf_counter()

    def layer_done(self, layer: int) -> None:
        now = time.perf_counter()
        m = self._metrics
        (m._layer_mla if layer in self._mla else m._layer_kda).observe(now - self._mark)
        if layer == self._last:
            m._chunk.observe(now - self._chunk_mark)

    def resume(self, layer: int) -> None:
        self._mark = time.perf_counter()
        if layer == self._last:
            self._chunk_mark = self._mark


class _NoTimer:
    def layer_done(self, layer: int) -> None:
        pass

    def resume(self, layer: int) -> None:
        pass


class PrefillMetrics:
    def __init__(self, identity: Identity | None, registry: CollectorRegistry | None = None):
        """``identity`` None: disabled."""
        self.identity, self.registry = identity, registry
        self.enabled = identity is not None
        if identity is None:
            return
        labels = identity.labels
        tokens = family(registry, Counter, "prefill_tokens", "Prompt tokens prefilled: computed or reused",
                        (*IDENTITY_LABELS, "kind"))
        self._computed, self._reused = tokens.labels(**labels, kind="computed"), tokens.labels(**labels, kind="reused")
        self._prefill_s = family(registry, Histogram, "prefill_seconds",
                                 "One prefill: reserve, reuse, compute, push, store", IDENTITY_LABELS,
                                 buckets=REQUEST_BUCKETS).labels(**labels)
        self._chunk = family(registry, Histogram, "prefill_chunk_seconds", "Compute of one prefill chunk",
                             IDENTITY_LABELS, buckets=STEP_BUCKETS).labels(**labels)
        layer = family(registry, Histogram, "prefill_layer_seconds", "Compute of one layer of one chunk",
                       (*IDENTITY_LABELS, "kind"), buckets=LAYER_BUCKETS)
        self._layer_kda, self._layer_mla = layer.labels(**labels, kind="kda"), layer.labels(**labels, kind="mla")
        stage = family(registry, Histogram, "prefill_stage_seconds",
                       "Seconds one prefill spent in a stage: queue, reuse, compute, push, verdict, store",
                       (*IDENTITY_LABELS, "stage"), buckets=STEP_BUCKETS)
        self._stages = {name: stage.labels(**labels, stage=name) for name in STAGES}

    @classmethod
    def disabled(cls) -> PrefillMetrics:
        return cls(None)

    def layer_timer(self, last_layer: int, mla_layers: Container[int]) -> LayerTimer | _NoTimer:
        return LayerTimer(self, last_layer, mla_layers) if self.enabled else _NoTimer()

    def prefilled(self, num_computed: int, num_reused: int, prefill_s: float) -> None:
        if self.enabled:
            self._computed.inc(num_computed)
            self._reused.inc(num_reused)
            self._prefill_s.observe(prefill_s)

    def stages(self, seconds: Mapping[str, float]) -> None:
        """One prefill's seconds per stage (``runner.StageClock``)."""
        if self.enabled:
            for name, value in seconds.items():
                self._stages[name].observe(value)

    def watch(self, runner: Any) -> None:
        """Read ``runner.load()`` and its page pool at every scrape (held weakly)."""
        if self.enabled:
            scrape_collector(self.registry, "prefill").add(self.identity, weak_source(runner, self._gauges))

    def _gauges(self, runner: Any) -> list[Any]:
        assert self.identity is not None
        load = runner.load()
        values = (
            ("prefill_queued_requests", "Prefills waiting for the engine", load.num_queued),
            ("prefill_running_requests", "Prefills running", load.num_running),
            ("prefill_free_pages", "Free KV cache pages of the prefill engine", load.num_free_pages),
            ("prefill_total_pages", "KV cache pages of the prefill engine", runner.cache.pool.num_pages),
        )
        return identity_gauges(self.identity, values)
