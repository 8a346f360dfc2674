"""Receiver-side bookkeeping of layerwise transfers: which chunks of which request have
arrived, whether a chunk fits what the destination expects, and who is waiting.

``RequestTable`` owns every expected request from ``add`` until ``wait_complete``/``cancel``
removes it. The I/O thread calls ``admit``/``record``/``finish``/``fail*``; caller threads call
``add``/``wait_*``/``cancel``. One ``threading.Condition`` guards all of it and wakes waiters;
no I/O happens under it. Layer ids are model layer indices (MLA and KDA layers share them);
blob ids are separate.

Token coverage of an MLA layer is a sorted list of merged half-open intervals::

    expected   [token_start ..................................... token_end)
    received   [0, 64) [64, 128)           [192, 256)
    covered    [(0, 128), (192, 256)]      -> layer incomplete: [128, 192) missing
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.transfer.base import Expected, Sink, TransferError, TransferResult
from kvstore.transfer.frames import DType, FrameHeader, Kind

KDA_PARTS = frozenset({Kind.KDA_STATE, Kind.KDA_CONV})


@dataclass
class _Progress:
    """Mutable state of one request; guarded by the owning table's condition."""

    request_id: str
    expected: Expected
    sink: Sink
    started_at: float
    deadline_at: float
    conn_id: int | None = None
    mla_covered: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    kda_parts: dict[int, set[Kind]] = field(default_factory=dict)
    blobs: set[int] = field(default_factory=set)
    done_layers: set[int] = field(default_factory=set)
    sender_units: int | None = None
    error: str | None = None
    complete: bool = False
    num_frames: int = 0
    num_bytes: int = 0

    @property
    def all_chunks_in(self) -> bool:
        return self.done_layers == self.expected.layers and len(self.blobs) == self.expected.num_blobs


def chunk_problem(expected: Expected, progress: _Progress, header: FrameHeader) -> str | None:
    """Why ``header``'s chunk does not fit the destination, or None when it does."""
    if header.kind == Kind.MLA_ROWS:
        return _mla_problem(expected, progress, header)
    if header.kind in KDA_PARTS:
        return _kda_problem(expected, progress, header)
    if header.kind == Kind.BLOB:
        return _blob_problem(expected, progress, header)
    return f"{header.kind.name} is not a data kind"


def _mla_problem(expected: Expected, progress: _Progress, header: FrameHeader) -> str | None:
    layer, t0, t1 = header.layer, header.token_start, header.token_end
    if layer not in expected.mla_layers:
        return f"layer {layer} is not an expected MLA layer {sorted(expected.mla_layers)}"
    if not expected.token_start <= t0 < t1 <= expected.token_end:
        return f"tokens [{t0}, {t1}) outside the expected range [{expected.token_start}, {expected.token_end})"
    want_shape = (t1 - t0, *expected.mla_row_shape)
    if header.shape != want_shape or header.dtype != expected.mla_dtype:
        return (
            f"chunk is {header.dtype.name.lower()} {header.shape}, destination expects "
            f"{expected.mla_dtype.name.lower()} {want_shape}"
        )
    overlapping = [(a, b) for a, b in progress.mla_covered.get(layer, ()) if a < t1 and t0 < b]
    if overlapping:
        return f"tokens [{t0}, {t1}) of layer {layer} overlap tokens already received {overlapping}"
    return None


def _kda_problem(expected: Expected, progress: _Progress, header: FrameHeader) -> str | None:
    if header.layer not in expected.kda_layers:
        return f"layer {header.layer} is not an expected KDA layer {sorted(expected.kda_layers)}"
    want_shape = expected.kda_state_shape if header.kind == Kind.KDA_STATE else expected.kda_conv_shape
    if header.shape != tuple(want_shape) or header.dtype != expected.kda_dtype:
        return (
            f"{header.kind.name} is {header.dtype.name.lower()} {header.shape}, destination expects "
            f"{expected.kda_dtype.name.lower()} {tuple(want_shape)}"
        )
    if header.kind in progress.kda_parts.get(header.layer, ()):
        return f"duplicate {header.kind.name} for layer {header.layer}"
    return None


def _blob_problem(expected: Expected, progress: _Progress, header: FrameHeader) -> str | None:
    if not 0 <= header.layer < expected.num_blobs:
        return f"blob index {header.layer} outside [0, {expected.num_blobs})"
    if header.dtype != DType.UINT8 or header.body_bytes > expected.max_blob_bytes:
        kind = header.dtype.name.lower()
        return f"blob is {kind} of {header.body_bytes} bytes; limit {expected.max_blob_bytes} uint8"
    if header.layer in progress.blobs:
        return f"duplicate blob {header.layer}"
    return None


def _merge(intervals: list[tuple[int, int]], new: tuple[int, int]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted([*intervals, new]):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def describe_missing(progress: _Progress, limit: int = 4) -> str:
    """What has not arrived yet, e.g. ``layer 3 tokens [(0, 64)] of [0, 128); blob 1``."""
    exp = progress.expected
    items: list[str] = []
    for layer in sorted(exp.mla_layers):
        if layer not in progress.done_layers:
            covered = progress.mla_covered.get(layer, [])
            items.append(f"layer {layer} has tokens {covered} of [{exp.token_start}, {exp.token_end})")
    for layer in sorted(exp.kda_layers):
        missing = KDA_PARTS - progress.kda_parts.get(layer, set())
        if missing:
            items.append(f"layer {layer} lacks {sorted(k.name for k in missing)}")
    items += [f"blob {i} missing" for i in range(exp.num_blobs) if i not in progress.blobs]
    if progress.all_chunks_in and progress.sender_units is None:
        items.append("all chunks in but no END from the sender")
    extra = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return "; ".join(items[:limit]) + extra


class RequestTable:
    """Expected requests and their progress; see the module docstring for threading."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        on_fail: Callable[[str, int, str], None] | None = None,
    ):
        """``on_fail(request_id, conn_id, reason)`` runs, under the lock and so must not block,
        whenever a request bound to a connection fails; the receiver uses it to tell the sender."""
        self._clock = clock
        self._on_fail = on_fail
        self._cond = threading.Condition()
        self._requests: dict[str, _Progress] = {}

    def add(self, request_id: str, sink: Sink, expected: Expected, deadline_s: float) -> None:
        with self._cond:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already expected")
            now = self._clock()
            self._requests[request_id] = _Progress(request_id, expected, sink, now, now + deadline_s)

    def __len__(self) -> int:
        with self._cond:
            return len(self._requests)

    # ---- I/O thread ------------------------------------------------------------------------

    def admit(self, header: FrameHeader, conn_id: int) -> tuple[Sink | None, str | None]:
        """``(sink, None)`` for a chunk that fits, else ``(None, reason)``; a misfit fails the request."""
        with self._cond:
            progress = self._requests.get(header.request_id)
            if progress is None:
                return None, f"request {header.request_id!r} is not expected by this receiver"
            if progress.error is not None:
                return None, progress.error
            if progress.complete:
                return (
                    None,
                    f"request {header.request_id!r} already complete; extra chunk {header.describe()}",
                )
            if progress.conn_id not in (None, conn_id):
                reason = f"request {header.request_id!r} arrived on a second connection"
            else:
                progress.conn_id = conn_id
                reason = chunk_problem(progress.expected, progress, header)
            if reason is not None:
                reason = f"rejected {header.describe()}: {reason}"
                self._fail_locked(progress, reason)
                return None, reason
            return progress.sink, None

    def record(self, header: FrameHeader) -> None:
        """Count an admitted chunk the sink has written; wakes waiters of finished layers."""
        with self._cond:
            progress = self._requests.get(header.request_id)
            if progress is None or progress.error is not None:
                return  # cancelled or failed meanwhile
            progress.num_frames += 1
            progress.num_bytes += header.body_bytes
            if self._mark_chunk(progress, header):
                self._cond.notify_all()  # waiters care about whole layers, not chunks

    def _mark_chunk(self, progress: _Progress, header: FrameHeader) -> bool:
        """Count the chunk; True when it completed a layer or blob."""
        exp, layer = progress.expected, header.layer
        if header.kind == Kind.MLA_ROWS:
            covered = _merge(progress.mla_covered.get(layer, []), (header.token_start, header.token_end))
            progress.mla_covered[layer] = covered
            done = covered == [(exp.token_start, exp.token_end)]
        elif header.kind in KDA_PARTS:
            parts = progress.kda_parts.setdefault(layer, set())
            parts.add(header.kind)
            done = parts == KDA_PARTS
        else:
            progress.blobs.add(layer)
            return True
        if done:
            progress.done_layers.add(layer)
        return done

    def finish(self, request_id: str, num_units: int, conn_id: int) -> str | None:
        """The sender's END: completes the request, or returns the reason it failed."""
        with self._cond:
            progress = self._requests.get(request_id)
            if progress is None:
                return f"END for request {request_id!r}, which is not expected by this receiver"
            if progress.error is not None:
                return progress.error
            progress.conn_id = conn_id if progress.conn_id is None else progress.conn_id
            progress.sender_units = num_units
            if num_units != progress.expected.num_units:
                reason = (
                    f"sender finished request {request_id!r} with {num_units} layers+blobs, "
                    f"receiver expects {progress.expected.num_units}"
                )
            elif not progress.all_chunks_in:
                reason = f"request {request_id!r} ended with chunks missing (truncated transfer): " + describe_missing(
                    progress
                )
            else:
                progress.complete = True
                self._cond.notify_all()
                return None
            self._fail_locked(progress, reason)
            return reason

    def fail(self, request_id: str, reason: str) -> int | None:
        """Fail a pending request; returns its connection id when the request was newly failed."""
        with self._cond:
            progress = self._requests.get(request_id)
            if progress is None or progress.error is not None or progress.complete:
                return None
            self._fail_locked(progress, reason)
            return progress.conn_id

    def fail_connection(self, conn_id: int, reason: str) -> list[str]:
        """Fail every incomplete request bound to ``conn_id``; returns their ids."""
        with self._cond:
            failed = [
                rid for rid, p in self._requests.items() if p.conn_id == conn_id and not p.complete and p.error is None
            ]
            for rid in failed:
                self._fail_locked(self._requests[rid], f"request {rid!r}: {reason}")
            return failed

    def expire(self, request_id: str) -> tuple[int | None, str] | None:
        """Fail the request if its deadline has passed: ``(connection id, reason)`` if newly failed."""
        with self._cond:
            progress = self._requests.get(request_id)
            if progress is None or progress.complete or progress.error is not None:
                return None
            if self._clock() < progress.deadline_at:
                return None
            self._expire_locked(request_id, progress)
            return progress.conn_id, progress.error

    def fail_all(self, reason: str) -> None:
        """Fail every pending request (the receiver is closing)."""
        with self._cond:
            for rid, progress in self._requests.items():
                if not progress.complete and progress.error is None:
                    self._fail_locked(progress, f"request {rid!r}: {reason}")

    def _expire_locked(self, request_id: str, progress: _Progress) -> None:
        deadline_s = progress.deadline_at - progress.started_at
        self._fail_locked(
            progress,
            f"request {request_id!r} missed its deadline of {deadline_s:.3g} s; missing: {describe_missing(progress)}",
        )

    def _fail_locked(self, progress: _Progress, reason: str) -> None:
        progress.error = reason
        self._cond.notify_all()
        if progress.conn_id is not None and self._on_fail is not None:
            self._on_fail(progress.request_id, progress.conn_id, reason)

    # ---- caller threads --------------------------------------------------------------------

    def wait_layer(self, request_id: str, layer: int, timeout_s: float | None) -> None:
        """Block until ``layer`` (or blob ``layer`` of a blob-only request) is in the destination."""

        def ready(p: _Progress) -> bool:
            return layer in p.done_layers or (not p.expected.layers and layer in p.blobs)

        with self._cond:
            progress = self._get(request_id)
            if layer not in progress.expected.layers and not 0 <= layer < progress.expected.num_blobs:
                raise ValueError(f"layer {layer} is not expected for request {request_id!r}")
            self._wait(request_id, progress, ready, timeout_s, f"layer {layer}")

    def wait_complete(self, request_id: str, timeout_s: float | None) -> TransferResult:
        """Block until the request is complete; removes it and returns its result, or raises."""
        with self._cond:
            progress = self._get(request_id)
            try:
                self._wait(request_id, progress, lambda p: p.complete, timeout_s, "completion")
            except TransferError:
                if progress.error is not None:
                    del self._requests[request_id]
                raise
            del self._requests[request_id]
            return TransferResult(
                request_id, progress.num_frames, progress.num_bytes, self._clock() - progress.started_at
            )

    def cancel(self, request_id: str) -> int | None:
        """Forget the request (waiters get TransferError); returns its connection id, if bound."""
        with self._cond:
            progress = self._requests.pop(request_id, None)
            if progress is None:
                return None
            if progress.error is None and not progress.complete:
                self._fail_locked(progress, f"request {request_id!r} was cancelled by the receiver")
            return progress.conn_id

    def _get(self, request_id: str) -> _Progress:
        progress = self._requests.get(request_id)
        if progress is None:
            raise ValueError(f"request {request_id!r} is not expected (or already collected)")
        return progress

    def _wait(
        self,
        request_id: str,
        progress: _Progress,
        ready: Callable[[_Progress], bool],
        timeout_s: float | None,
        what: str,
    ) -> None:
        """Wait under the condition; the request's deadline bounds every wait."""
        user_until = None if timeout_s is None else self._clock() + timeout_s
        while True:
            if progress.error is not None:
                raise TransferError(progress.error, request_id)
            if ready(progress):
                return
            now = self._clock()
            if now >= progress.deadline_at:
                self._expire_locked(request_id, progress)
                continue
            if user_until is not None and now >= user_until:
                raise TransferError(
                    f"timed out after {timeout_s:.3g} s waiting for {what} of request "
                    f"{request_id!r}; missing: {describe_missing(progress)}",
                    request_id,
                )
            until = progress.deadline_at if user_until is None else min(user_until, progress.deadline_at)
            self._cond.wait(until - now)

    def check_integrity(self) -> None:
        """Raise AssertionError if any request's bookkeeping is inconsistent."""
        with self._cond:
            for rid, p in self._requests.items():
                assert not (p.complete and p.error is not None), rid
                assert p.done_layers <= p.expected.layers, rid
                assert p.blobs <= set(range(p.expected.num_blobs)), rid
                assert not p.complete or p.all_chunks_in, rid
                for layer, covered in p.mla_covered.items():
                    assert all(a < b for a, b in covered), (rid, layer)
