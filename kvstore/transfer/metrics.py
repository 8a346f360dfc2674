"""The transfer engine's Prometheus metrics, counted at the frame level: body bytes and data
frames by backend and direction, per-request transfer seconds (sender side: first frame
queued to the receiver's verdict), checksum failures (also counted as
``tidekv:kv_corruption_total{where="transfer"}``, the store's corruption family), aborted
transfers, and connections that failed the authentication handshake (``auth``).

Senders and receivers are built deep inside the workers (``connect``, ``TransferHub``), so
they need no metrics object: by default they report to the process context set by
``runtime.metrics.enable`` / ``start_metrics(identity=...)`` and record nothing while it is
off (``process_link``: the context is looked up at each call, so a receiver made before the
context was set still reports). Labels: ``worker_id``, ``role``, ``model`` of that context,
``backend`` (tcp, shm, ucx) and ``direction`` (send, recv). Thread-safe; called from the
I/O thread and the callers' threads.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvstore.metrics import corruption_counter
from runtime.metrics import IDENTITY_LABELS, TRANSFER_BUCKETS, Identity, ProcessMetrics, family, process_metrics

DIRECTIONS = ("send", "recv")


class LinkMetrics:
    """The children of one (identity, backend, direction)."""

    def __init__(self, identity: Identity, backend: str, direction: str, registry: CollectorRegistry | None = None):
        labels = {**identity.labels, "backend": backend, "direction": direction}
        names = (*IDENTITY_LABELS, "backend", "direction")
        self._bytes = family(registry, Counter, "transfer_bytes", "KV body bytes moved by the transfer engine",
                             names).labels(**labels)
        self._frames = family(registry, Counter, "transfer_frames", "Data frames moved by the transfer engine",
                              names).labels(**labels)
        self._checksum = family(registry, Counter, "transfer_checksum_failures",
                                "Frames whose body failed its checksum", names).labels(**labels)
        self._aborted = family(registry, Counter, "transfer_aborted", "Requests aborted by the sender",
                               names).labels(**labels)
        self._auth = family(registry, Counter, "transfer_auth_failures",
                            "Connections dropped because the peer failed the authentication handshake",
                            names).labels(**labels)
        self._corruption = corruption_counter(registry, identity, "transfer")
        self._seconds = family(registry, Histogram, "transfer_seconds",
                               "One request's transfer, first frame queued to the receiver's verdict",
                               names, buckets=TRANSFER_BUCKETS).labels(**labels)

    def frame(self, num_bytes: int) -> None:
        self._frames.inc()
        self._bytes.inc(num_bytes)

    def checksum_failure(self) -> None:
        self._checksum.inc()
        self._corruption.inc()

    def aborted(self) -> None:
        self._aborted.inc()

    def auth_failure(self) -> None:
        self._auth.inc()

    def transferred(self, seconds: float) -> None:
        self._seconds.observe(seconds)


class _NoLink:
    def frame(self, num_bytes: int) -> None:
        pass

    def checksum_failure(self) -> None:
        pass

    def aborted(self) -> None:
        pass

    def auth_failure(self) -> None:
        pass

    def transferred(self, seconds: float) -> None:
        pass


_NO_LINK = _NoLink()


class ProcessLink:
    """``LinkMetrics`` of the current process context, or nothing while metrics are off."""

    def __init__(self, backend: str, direction: str):
        if direction not in DIRECTIONS:
            raise ValueError(f"direction {direction!r} not in {DIRECTIONS}")
        self.backend, self.direction = backend, direction
        self._context: ProcessMetrics | None = None
        self._link: LinkMetrics | _NoLink = _NO_LINK

    def _current(self) -> LinkMetrics | _NoLink:
        context = process_metrics()
        if context is not self._context:  # set, changed or turned off since the last call
            self._context = context
            self._link = _NO_LINK if context is None else LinkMetrics(
                context.identity, self.backend, self.direction, context.registry)
        return self._link

    def frame(self, num_bytes: int) -> None:
        self._current().frame(num_bytes)

    def checksum_failure(self) -> None:
        self._current().checksum_failure()

    def aborted(self) -> None:
        self._current().aborted()

    def auth_failure(self) -> None:
        self._current().auth_failure()

    def transferred(self, seconds: float) -> None:
        self._current().transferred(seconds)


def process_link(address_or_scheme: str, direction: str) -> ProcessLink:
    """The process-context metrics of a link to/from ``tcp://...`` (or a bare scheme)."""
    return ProcessLink(address_or_scheme.partition("://")[0] or "tcp", direction)
