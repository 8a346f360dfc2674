"""Receiver-side bookkeeping of layerwise transfers: which chunks of which request have
arrived (``progress`` has the per-request state and the fit rules), who is waiting, and when a
failed request's memory may be reused.

``RequestTable`` owns every expected request from ``add`` until ``wait_complete``/``cancel``
removes it. The I/O thread calls ``admit``/``record``/``finish``/``fail*``/``open``/``fence*``;
caller threads call ``add``/``wait_*``/``cancel``. One ``threading.Condition`` guards all of it
and wakes waiters; no I/O happens under it. Layer ids are model layer indices (MLA and KDA
layers share them); blob ids are separate.

Direct placement (shm): ``open`` hands a request's destination to one connection, whose peer
then writes chunks straight into it. A failed or cancelled request is removed only once that
peer is fenced (``fence``: its END, ABORT or REVOKED arrived; ``fence_connection``: it is gone),
or ``fence_timeout_s`` passed, so the caller never frees memory a sender is still writing::

    open ──► PLACE sent ──► direct chunks ──► END ─────────────────► complete (fenced)
                                 └─► failure ──► ERROR ──► REVOKED ──► wait_complete raises

The same holds for a chunk the receiver itself writes into the destination, from ``admit``
to ``landed`` (a body received straight into the pages arrives over many reads).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.transfer.base import Expected, Sink, TransferError, TransferResult
from kvstore.transfer.frames import FrameHeader, Kind
from kvstore.transfer.placement import LocalPlacement
from kvstore.transfer.progress import (
    KDA_PARTS,
    TransferProgress,
    chunk_problem,
    claim,
    describe_missing,
    merge_interval,
)

logger = logging.getLogger(__name__)


class RequestTable:
    """Expected requests and their progress; see the module docstring for threading."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        on_fail: Callable[[str, int, str], None] | None = None,
        fence_timeout_s: float = 2.0,
    ):
        """``on_fail(request_id, conn_id, reason)`` runs, under the lock and so must not block,
        whenever a request bound to a connection fails; the receiver uses it to tell the sender.
        ``fence_timeout_s`` bounds how long a failed, placed request waits for its peer's fence."""
        self._clock = clock
        self._on_fail = on_fail
        self._fence_timeout_s = fence_timeout_s
        self._cond = threading.Condition()
        self._requests: dict[str, TransferProgress] = {}

    def add(self, request_id: str, sink: Sink, expected: Expected, deadline_s: float) -> None:
        with self._cond:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already expected")
            now = self._clock()
            self._requests[request_id] = TransferProgress(request_id, expected, sink, now, now + deadline_s)

    def __len__(self) -> int:
        with self._cond:
            return len(self._requests)

    # ---- I/O thread ------------------------------------------------------------------------

    def admit(self, header: FrameHeader, conn_id: int) -> tuple[Sink | None, str | None]:
        """``(sink, None)`` for a chunk that fits, else ``(None, reason)``; a misfit fails the
        request. An admitted chunk is landing until ``landed``: the request's memory is not
        handed back (``cancel``, a failed ``wait_complete``) while it is written."""
        with self._cond:
            progress, reason = self._admit_locked(header, conn_id)
            if progress is None:
                return None, reason
            progress.landing += 1
            return progress.sink, None

    def landed(self, request_id: str) -> None:
        """An admitted chunk of the request is written into its sink, or will never be."""
        with self._cond:
            progress = self._requests.get(request_id)
            if progress is not None and progress.landing > 0:
                progress.landing -= 1
                self._cond.notify_all()

    def admit_direct(self, header: FrameHeader, conn_id: int) -> tuple[LocalPlacement | None, str | None]:
        """Like ``admit`` for a chunk the peer wrote into the destination: ``(placement, None)``
        when it fits and this connection holds the request's placement, else ``(None, reason)``."""
        with self._cond:
            progress, reason = self._admit_locked(header, conn_id)
            if progress is None:
                return None, reason
            if progress.placement is None:
                reason = f"rejected {header.describe()}: written directly, but no placement was given to its connection"
                self._fail_locked(progress, reason)
                return None, reason
            return progress.placement, None

    def _admit_locked(self, header: FrameHeader, conn_id: int) -> tuple[TransferProgress | None, str | None]:
        progress = self._requests.get(header.request_id)
        if progress is None:
            return None, f"request {header.request_id!r} is not expected by this receiver"
        if progress.error is not None:
            return None, progress.error
        if progress.complete:
            return None, f"request {header.request_id!r} already complete; extra chunk {header.describe()}"
        if progress.conn_id not in (None, conn_id):
            reason = f"request {header.request_id!r} arrived on a second connection"
        else:
            progress.conn_id = conn_id
            reason = chunk_problem(progress.expected, progress, header)
        if reason is not None:
            reason = f"rejected {header.describe()}: {reason}"
            self._fail_locked(progress, reason)
            return None, reason
        claim(progress, header)
        return progress, None

    def open(self, request_id: str, conn_id: int) -> Sink | None:
        """Bind a request to the connection asking for its placement; returns its sink, or None
        when the request is unknown, over, or bound to another connection."""
        with self._cond:
            progress = self._requests.get(request_id)
            if progress is None or progress.error is not None or progress.complete:
                return None
            if progress.conn_id not in (None, conn_id):
                return None
            progress.conn_id = conn_id
            return progress.sink

    def placed(self, request_id: str, conn_id: int, placement: LocalPlacement) -> bool:
        """Record that ``placement`` goes to connection ``conn_id`` (not fenced until its END);
        False, and nothing recorded, if the request failed or moved meanwhile."""
        with self._cond:
            progress = self._requests.get(request_id)
            if progress is None or progress.error is not None or progress.complete or progress.conn_id != conn_id:
                return False
            progress.placement = placement
            progress.fenced = False
            return True

    def fence(self, request_id: str, conn_id: int) -> None:
        """The peer on ``conn_id`` writes nothing more into the request's placement."""
        with self._cond:
            progress = self._requests.get(request_id)
            if progress is not None and progress.conn_id == conn_id and not progress.fenced:
                progress.fenced = True
                self._cond.notify_all()

    def fence_connection(self, conn_id: int) -> None:
        """The peer on ``conn_id`` is gone: every placement it held is fenced."""
        with self._cond:
            for progress in self._requests.values():
                if progress.conn_id == conn_id:
                    progress.fenced = True
            self._cond.notify_all()

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

    def _mark_chunk(self, progress: TransferProgress, header: FrameHeader) -> bool:
        """Count the chunk; True when it completed a layer or blob."""
        exp, layer = progress.expected, header.layer
        if header.kind == Kind.MLA_ROWS:
            covered = merge_interval(progress.mla_covered.get(layer, []), (header.token_start, header.token_end))
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
            if progress.conn_id == conn_id and not progress.fenced:
                progress.fenced = True  # the peer writes nothing after its END
                self._cond.notify_all()
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

    def fail(self, request_id: str, reason: str, conn_id: int | None = None) -> int | None:
        """Fail a pending request (with ``conn_id``: only while it is bound to that connection,
        not a new attempt under the same id); returns its connection id when newly failed."""
        with self._cond:
            progress = self._requests.get(request_id)
            if progress is None or progress.error is not None or progress.complete:
                return None
            if conn_id is not None and progress.conn_id != conn_id:
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
        """Fail every pending request (the receiver is closing). Placements count as fenced: a
        closing worker reuses no memory, and its waiters should not wait out the fence."""
        with self._cond:
            for rid, progress in self._requests.items():
                if not progress.complete and progress.error is None:
                    self._fail_locked(progress, f"request {rid!r}: {reason}")
                progress.fenced = True
            self._cond.notify_all()

    def _expire_locked(self, request_id: str, progress: TransferProgress) -> None:
        deadline_s = progress.deadline_at - progress.started_at
        self._fail_locked(
            progress,
            f"request {request_id!r} missed its deadline of {deadline_s:.3g} s; missing: {describe_missing(progress)}",
        )

    def _fail_locked(self, progress: TransferProgress, reason: str) -> None:
        progress.error = reason
        self._cond.notify_all()
        if progress.conn_id is not None and self._on_fail is not None:
            self._on_fail(progress.request_id, progress.conn_id, reason)

    # ---- caller threads --------------------------------------------------------------------

    def wait_layer(self, request_id: str, layer: int, timeout_s: float | None) -> None:
        """Block until ``layer`` (or blob ``layer`` of a blob-only request) is in the destination."""

        def ready(p: TransferProgress) -> bool:
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
                    self._wait_fenced(progress)
                    del self._requests[request_id]
                raise
            del self._requests[request_id]
            return TransferResult(
                request_id, progress.num_frames, progress.num_bytes, self._clock() - progress.started_at
            )

    def receiving(self, request_id: str) -> bool:
        """The request's chunks are arriving: at least one came, and it is neither complete nor failed."""
        with self._cond:
            progress = self._requests.get(request_id)
            return progress is not None and progress.num_frames > 0 and not progress.complete and progress.error is None

    def failure(self, request_id: str) -> str | None:
        """Why the request failed, while it is not collected yet (no chunk of it will be
        admitted again); None when it has not failed or is unknown."""
        with self._cond:
            progress = self._requests.get(request_id)
            return None if progress is None else progress.error

    def cancel(self, request_id: str) -> int | None:
        """Forget the request (waiters get TransferError) once its placement, if any, is fenced;
        returns its connection id, if bound."""
        with self._cond:
            progress = self._requests.get(request_id)
            if progress is None:
                return None
            if progress.error is None and not progress.complete:
                self._fail_locked(progress, f"request {request_id!r} was cancelled by the receiver")
            self._wait_fenced(progress)
            self._requests.pop(request_id, None)
            return progress.conn_id

    def _wait_fenced(self, progress: TransferProgress) -> None:
        """Wait (lock held) until nothing writes into the request's memory any more: no peer
        holding its placement, no chunk of it landing here; at most ``fence_timeout_s``, then
        its memory may be reused."""
        until = self._clock() + self._fence_timeout_s
        while not progress.fenced or progress.landing:
            now = self._clock()
            if now >= until:
                who = ("the sender holding its placement did not confirm it stopped writing" if not progress.fenced
                       else f"{progress.landing} of its chunks were still being written")
                logger.error("request %r: %s within %.3g s; its destination may still be written",
                             progress.request_id, who, self._fence_timeout_s)
                return
            self._cond.wait(until - now)

    def _get(self, request_id: str) -> TransferProgress:
        progress = self._requests.get(request_id)
        if progress is None:
            raise ValueError(f"request {request_id!r} is not expected (or already collected)")
        return progress

    def _wait(
        self,
        request_id: str,
        progress: TransferProgress,
        ready: Callable[[TransferProgress], bool],
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
                assert p.fenced or p.placement is not None, rid
                assert p.blobs <= p.claimed_blobs, rid  # what landed was admitted
                for layer, covered in p.mla_covered.items():
                    assert all(a < b for a, b in covered), (rid, layer)
                    claimed = p.claimed_rows.get(layer, [])
                    assert all(any(a <= t0 and t1 <= b for a, b in claimed) for t0, t1 in covered), (rid, layer)
