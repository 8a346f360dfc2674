"""Prometheus plumbing shared by every Tidekv process: the registry, the ``/metrics`` server,
the label policy, the bucket sets and the naming rule.

Registry: ``REGISTRY`` is the one ``prometheus_client.CollectorRegistry`` of the process (not
the library's global default, so nothing a dependency registers leaks into our endpoint).
Each package's ``metrics`` module defines its families next to what they measure; a family is
created once per registry (``family``), and a component takes a small metrics object bound to
its labels (``DecodeMetrics(identity)``...) so the hot path only calls ``observe``/``inc`` on
prepared children (about a microsecond each, under the child's own lock).

Naming: metric names use the ``tidekv:`` prefix, as the project's design (DESIGN.md section
9) and its peers do (``vllm:``, ``sglang:``), so a vLLM dashboard reads the same way here and
``{__name__=~"tidekv:.*"}`` selects everything of ours. Prometheus advises keeping colons for
recording rules; we keep the two apart by shape instead: a raw metric has exactly one colon
(``tidekv:time_to_first_token_seconds``), a recording rule has two, in the ``level:metric:
operation`` convention with the level ``tidekv`` (``tidekv:time_to_first_token_seconds:p99_1m``,
see ``deploy/prometheus/rules.yml``).

Labels: ``worker_id``, ``role`` and ``model`` (``Identity``) describe a worker; the Conductor's
own metrics carry ``model`` only (Prometheus' ``instance`` tells replicas apart). Tenants pass
through ``TenantLabels``: an allow-list from the config, anything else becomes ``other``. No
request ids, prompts or other unbounded values ever become label values.

Server: ``start_metrics(host, port)`` serves ``REGISTRY`` on ``http://host:port/metrics`` (the
classic text format, which keeps the colons) from threads of its own
(``runtime.metrics_server``: a few connections at a time, each with one deadline, so slow
clients cannot pile up); port 0 takes a free port, -1 serves nothing (``MetricsServer.address``
is "" then). The host is bound like the gRPC port (127.0.0.1 unless told otherwise). Given
TLS files with a certificate, it serves HTTPS (``https://host:port/metrics``).
"""

from __future__ import annotations

import bisect
import ssl
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from runtime.metrics_server import BoundedHttpServer, ServerLimits

PREFIX = "tidekv:"
OFF_PORT = -1
OTHER_TENANT = "other"
DEFAULT_TENANT = "default"  # label of requests that name no tenant
DEFAULT_LIMITS = ServerLimits()  # of every /metrics server (runtime.metrics_server)

# Spacings chosen for these latencies: vLLM's TTFT and ITL buckets, extended below 10 ms
# because the tiny CPU model and a local cluster answer in milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
LAYER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0)
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def token_buckets(max_tokens: int = 1 << 17) -> tuple[float, ...]:
    """1-2-5 spacing up to ``max_tokens`` (as vLLM's ``build_1_2_5_buckets``)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_tokens:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


prometheus_client.disable_created_metrics()  # no `_created` series next to every counter
REGISTRY = CollectorRegistry(auto_describe=True)


@dataclass(frozen=True)
class Identity:
    """Who a worker's series describe: label values of ``worker_id``, ``role`` and ``model``."""

    worker_id: str
    role: str
    model: str

    @property
    def labels(self) -> dict[str, str]:
        return {"worker_id": self.worker_id, "role": self.role, "model": self.model}


IDENTITY_LABELS = ("worker_id", "role", "model")


class TenantLabels:
    """The bounded tenant label: an allow-listed tenant is itself, no tenant is ``default``,
    any other tenant is ``other``. Pure and thread-safe."""

    def __init__(self, allowed: Iterable[str] = ()):
        self.allowed = frozenset(allowed)

    def label(self, tenant: str) -> str:
        if not tenant:
            return DEFAULT_TENANT
        return tenant if tenant in self.allowed else OTHER_TENANT

    @property
    def values(self) -> tuple[str, ...]:
        """Every label value this policy can produce (for pre-creating series)."""
        return (DEFAULT_TENANT, *sorted(self.allowed), OTHER_TENANT)


# ---- families -------------------------------------------------------------------------------

M = TypeVar("M")
_families: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Any]] = weakref.WeakKeyDictionary()
_families_lock = threading.Lock()


def family(registry: CollectorRegistry | None, kind: Callable[..., M], name: str, doc: str,
           labelnames: Sequence[str], **kwargs: Any) -> M:
    """The metric family ``PREFIX + name`` of ``registry`` (default ``REGISTRY``), created on
    first use, so two components of one process share a family and each adds its children.
    ValueError when the name was created with another kind or other labels."""
    registry = REGISTRY if registry is None else registry
    full = PREFIX + name
    with _families_lock:
        known = _families.setdefault(registry, {})
        existing = known.get(full)
        if existing is None:
            existing = known[full] = kind(full, doc, labelnames, registry=registry, **kwargs)
        elif not isinstance(existing, kind) or tuple(existing._labelnames) != tuple(labelnames):  # type: ignore[arg-type]
            raise ValueError(f"metric {full} exists as {type(existing).__name__}{existing._labelnames}")
        return existing


class ScrapeCollector:
    """A collector whose samples are computed at scrape time by ``sources`` (weakly held
    callables returning ``prometheus_client`` metric families), so gauges such as queue
    lengths cost nothing between scrapes. Add one source per component; a source whose owner
    is gone is dropped. Thread-safe."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self._sources: dict[Any, Callable[[], Iterable[Any]]] = {}
        self._lock = threading.Lock()
        (REGISTRY if registry is None else registry).register(self)

    def add(self, key: Any, source: Callable[[], Iterable[Any]]) -> None:
        """Replace the source registered under ``key`` (an identity: one source per component)."""
        with self._lock:
            self._sources[key] = source

    def remove(self, key: Any) -> None:
        with self._lock:
            self._sources.pop(key, None)

    def describe(self) -> list[Any]:
        return []  # computed at scrape time; nothing to check at registration

    def collect(self) -> Iterable[Any]:
        with self._lock:
            sources = list(self._sources.values())
        merged: dict[str, Any] = {}
        for source in sources:
            for fam in source():
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = fam
        return list(merged.values())


_collectors: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, ScrapeCollector]] = weakref.WeakKeyDictionary()


def scrape_collector(registry: CollectorRegistry | None, name: str) -> ScrapeCollector:
    """The registry's scrape-time collector named ``name`` (one per package), created on first use."""
    registry = REGISTRY if registry is None else registry
    with _families_lock:
        known = _collectors.setdefault(registry, {})
        if name not in known:
            known[name] = ScrapeCollector(registry)
        return known[name]


def weak_source(owner: Any, read: Callable[[Any], Iterable[Any]]) -> Callable[[], Iterable[Any]]:
    """A scrape source that calls ``read(owner)`` while ``owner`` lives, then yields nothing."""
    ref = weakref.ref(owner)

    def source() -> Iterable[Any]:
        obj = ref()
        return () if obj is None else read(obj)

    return source


def identity_gauges(identity: Identity, values: Iterable[tuple[str, str, float]]) -> list[Any]:
    """One gauge family per (name, doc, value), each with the single sample of ``identity``:
    what a worker's scrape-time source returns."""
    label_values = [identity.worker_id, identity.role, identity.model]
    out = []
    for name, doc, value in values:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=list(IDENTITY_LABELS))
        g.add_metric(label_values, value)
        out.append(g)
    return out


def observe_many(histogram: Any, values: Sequence[float]) -> None:
    """``histogram.observe(v)`` for every value, one increment per touched bucket instead of
    one per value (a request's token intervals in one call). Reads the prometheus_client child's
    ``_upper_bounds``/``_buckets``/``_sum`` (stable since 0.4); falls back to ``observe``."""
    bounds, buckets, total = (getattr(histogram, a, None) for a in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:
        for v in values:
            histogram.observe(v)
        return
    counts = [0] * len(bounds)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1  # first bound >= v, as observe() picks it
    for bucket, n in zip(buckets, counts, strict=True):
        if n:
            bucket.inc(n)
    total.inc(sum(values))


# ---- process context (for code that is not handed a metrics object) -------------------------

@dataclass(frozen=True)
class ProcessMetrics:
    identity: Identity
    registry: CollectorRegistry


_process: ProcessMetrics | None = None


def enable(identity: Identity, registry: CollectorRegistry | None = None) -> ProcessMetrics:
    """Turn on the metrics of code built without a metrics object (the transfer engine's
    senders and receivers) for this process, labelled ``identity``. Call once at start-up."""
    global _process
    _process = ProcessMetrics(identity, REGISTRY if registry is None else registry)
    return _process


def disable() -> None:
    """Turn the process context off again (tests; a process never needs it)."""
    global _process
    _process = None


def process_metrics() -> ProcessMetrics | None:
    """The process context set by ``enable``/``start_metrics``, or None while metrics are off."""
    return _process


# ---- the HTTP endpoint ---------------------------------------------------------------------

@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint (``address`` is ``host:port``), or none (address "")."""

    address: str
    _server: BoundedHttpServer | None = None
    tls: bool = False

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}/metrics" if self.address else ""

    def stop(self) -> None:
        """Stop serving and close the socket. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()


def start_metrics(host: str = "127.0.0.1", port: int = 0, identity: Identity | None = None,
                  registry: CollectorRegistry | None = None, advertise_host: str = "", tls: Any = None,
                  limits: ServerLimits = DEFAULT_LIMITS) -> MetricsServer:
    """Serve ``registry`` (default ``REGISTRY``) at ``http://host:port/metrics``; port 0 takes
    a free port, ``OFF_PORT`` (-1) serves nothing. ``identity`` also enables the process
    context (``enable``) for the transfer engine's metrics. ``advertise_host`` (default: host,
    loopback for a wildcard) is the host in ``address``. ``tls`` (``runtime.tls.TlsFiles``)
    with a certificate serves HTTPS. RuntimeError naming the address when it cannot bind."""
    if identity is not None:
        enable(identity, registry)
    if port == OFF_PORT:
        return MetricsServer("")
    if not 0 <= port < 65536:
        raise ValueError(f"metrics_port {port} not in -1..65535")
    context = None
    if tls is not None and tls.serves:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tls.cert, tls.key)
    reg = REGISTRY if registry is None else registry
    try:
        server = BoundedHttpServer(host, port, lambda: generate_latest(reg), limits, context)
    except OSError as e:
        raise RuntimeError(f"cannot serve metrics on {host}:{port}: {e}") from e
    shown = advertise_host or ("127.0.0.1" if host in ("0.0.0.0", "::", "") else host)
    return MetricsServer(f"{shown}:{server.port}", server, context is not None)
