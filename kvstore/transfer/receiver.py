"""Receiver: accepts sender connections on one or more backends, verifies every chunk and
writes it into the destination of the request it belongs to, or, for a chunk a same-host (shm)
sender wrote straight into the destination (``base.DirectSink``), verifies it there.

Threads: all connection handling, checksum verification and ``sink.write`` calls run on the
I/O thread (``ioloop.IoThread``), one connection's frames in order. On a link whose bodies
travel apart from the frame stream (ucx), a data frame's body is received while the next
headers are read and admitted (``landing``): bodies land concurrently, ACKs still go out in
order, and any other frame waits until every earlier one is handled. A data frame's
header is admitted before its body is read: a sink with ``views`` (``base.ViewSink``) then has
the body received straight into its destination (tcp: no staging copy, the checksum computed
as the body lands and compared once it is in; ucx: when the destination is one contiguous
view, checksummed there), any other sink gets ``write`` of a verified copy. Caller threads
use ``expect``/``wait_layer``/``wait_complete``/``cancel``, which go through the locked
``stream.RequestTable``; never call the blocking waits from the I/O thread.

Rejection policy: a chunk for a request that was never ``expect``-ed (or was cancelled,
completed or failed) is read, dropped, acknowledged (so the sender's in-flight bytes drain),
logged once, and answered with an ERROR frame naming the reason; the sender fails that request.
Any later failure of a request (checksum, misfit, sink rejection, deadline, cancel) is also
sent back as an ERROR on its connection. Frames are acknowledged (cumulatively) only after the
sink has copied them, so the sender's ``max_inflight_bytes`` also bounds what waits here. A
SYNC is answered (SYNCED) when it is reached: every earlier frame of its connection has been
handled by then.

Direct chunks (FLAG_DIRECT): an OPEN from an shm peer is answered with the request's placement
(PLACE) and binds the request to that connection. Each direct chunk is admitted like any other
(expected request and connection, layer, token range, shape, dtype; never trusting offsets from
the sender: the receiver's own placement says where the chunk lies) and counted only once the
checksum of the destination bytes matches its header. A chunk that fails any check fails the
request; the request's memory holds unverified bytes until then and garbage after, and is never
served: ``wait_complete`` raises, and returns (as ``cancel`` does) only when the sender has
confirmed it writes no more (REVOKED, END, ABORT, or it is gone; see ``stream``).

The I/O thread is shared by every sender and receiver of the process (unless one is given), so
a slow ``sink.write`` delays them all: sinks should copy and return.

Metrics (``kvstore.transfer.metrics``, the process context): frames and bytes read per
backend, checksum failures, aborts received.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import torch

from kvstore.transfer.base import (
    Expected,
    Frame,
    LinkClosed,
    RecvLink,
    Sink,
    TransferConfig,
    TransferError,
    TransferResult,
)
from kvstore.transfer.direct import checksum_of
from kvstore.transfer.frames import FLAG_DIRECT, FrameError, FrameHeader, Kind, control_header
from kvstore.transfer.ioloop import IoThread
from kvstore.transfer.landing import Landing
from kvstore.transfer.metrics import ProcessLink, process_link
from kvstore.transfer.registry import get_backend
from kvstore.transfer.stream import RequestTable

logger = logging.getLogger(__name__)
MAX_REASON_BYTES = 4096


def as_tensor(body: memoryview, header: FrameHeader) -> torch.Tensor:
    """A tensor view of a verified body (no copy); bf16 needs no numpy type."""
    dtype = getattr(torch, header.dtype.name.lower())
    if header.body_bytes == 0:
        return torch.empty(header.shape, dtype=dtype)
    return torch.frombuffer(body, dtype=dtype).view(header.shape)


class Receiver:
    """Receives layerwise KV chunks and blobs for expected requests; see the module docstring."""

    def __init__(
        self,
        config: TransferConfig | None = None,
        backends: str | Sequence[str] = "tcp",
        *,
        io: IoThread | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config or TransferConfig()
        self._io = io or IoThread.shared()
        self._table = RequestTable(clock, on_fail=self._on_request_failed, fence_timeout_s=self.config.fence_timeout_s)
        self._links: dict[int, RecvLink] = {}  # I/O thread only
        self._link_metrics: dict[int, ProcessLink] = {}  # I/O thread only
        self._conn_ids = itertools.count(1)
        self.frames_received = 0
        self.bytes_received = 0
        self.frames_rejected = 0
        self.frames_direct = 0  # data frames the peer wrote straight into the destination (shm)
        schemes = [backends] if isinstance(backends, str) else list(backends)
        self._listeners = {
            scheme: self._io.run(
                get_backend(scheme).listen(self.config, functools.partial(self._serve_link, scheme)),
                self.config.connect_timeout_s,
            )
            for scheme in schemes
        }

    @property
    def addresses(self) -> dict[str, str]:
        """Address per backend scheme, e.g. ``{"tcp": "tcp://127.0.0.1:40123"}``."""
        return {scheme: listener.address for scheme, listener in self._listeners.items()}

    @property
    def address(self) -> str:
        """The first backend's address."""
        return next(iter(self._listeners.values())).address

    @property
    def num_pending(self) -> int:
        return len(self._table)

    def expect(self, request_id: str, sink: Sink, expected: Expected, deadline_s: float | None = None) -> None:
        """Register a destination before the sender starts; the request fails after ``deadline_s``
        (default ``config.deadline_s``) unless complete."""
        deadline_s = self.config.deadline_s if deadline_s is None else deadline_s
        self._table.add(request_id, sink, expected, deadline_s)
        self._io.call_soon(self._arm_deadline, request_id, deadline_s)

    def wait_layer(self, request_id: str, layer: int, timeout_s: float | None = None) -> None:
        """Block until ``layer`` is in the destination; TransferError if the request fails."""
        self._check_caller()
        self._table.wait_layer(request_id, layer, timeout_s)

    def wait_complete(self, request_id: str, timeout_s: float | None = None) -> TransferResult:
        """Block until every expected chunk and the sender's END arrived; forgets the request.
        Raises TransferError (and forgets it) on corruption, truncation, peer death, abort or deadline."""
        self._check_caller()
        return self._table.wait_complete(request_id, timeout_s)

    def receiving(self, request_id: str) -> bool:
        """Chunks of the request have arrived, and it is neither complete nor failed."""
        return self._table.receiving(request_id)

    def failure(self, request_id: str) -> str | None:
        """Why the request failed (corruption, truncation, peer death, the sender's ABORT, its
        deadline) while nobody collected it yet: it can never complete. None if it has not."""
        return self._table.failure(request_id)

    def cancel(self, request_id: str) -> None:
        """Forget a request; waiters get TransferError and its sender is told to stop."""
        self._table.cancel(request_id)

    def close(self) -> None:
        """Stop listening, drop connections and fail whatever is pending."""
        self._table.fail_all("receiver closed")
        self._io.run(self._close_links(), self.config.connect_timeout_s)

    def check_integrity(self) -> None:
        self._table.check_integrity()

    def _check_caller(self) -> None:
        if self._io.in_thread():
            raise RuntimeError("Receiver waits block; call them from a worker thread, not the I/O thread")

    # ---- I/O thread ------------------------------------------------------------------------

    async def _close_links(self) -> None:
        for listener in self._listeners.values():
            listener.close()
        for link in list(self._links.values()):
            link.close()

    def _arm_deadline(self, request_id: str, deadline_s: float) -> None:
        self._io.loop.call_later(deadline_s, self._on_deadline, request_id)

    def _on_deadline(self, request_id: str) -> None:
        expired = self._table.expire(request_id)
        if expired is not None:
            logger.warning("transfer deadline: %s", expired[1])

    def _on_request_failed(self, request_id: str, conn_id: int, reason: str) -> None:
        """Any thread, under the table's lock: tell the request's sender from the I/O thread."""
        self._io.call_soon(self._tell_sender, conn_id, request_id, reason)

    def _tell_sender(self, conn_id: int, request_id: str, reason: str) -> None:
        link = self._links.get(conn_id)
        if link is not None:
            payload = reason.encode()[:MAX_REASON_BYTES]
            link.reply(control_header(Kind.ERROR, request_id, payload=payload), payload)

    async def _serve_link(self, scheme: str, link: RecvLink) -> None:
        conn_id = next(self._conn_ids)
        self._links[conn_id] = link
        self._link_metrics[conn_id] = process_link(scheme, "recv")
        told: set[str] = set()
        try:
            await self._serve_frames(link, conn_id, told)
        except Exception:  # outermost boundary of this connection's task
            logger.exception("transfer connection %d failed", conn_id)
            self._table.fail_connection(conn_id, "receiver error on its connection (see receiver log)")
        finally:
            self._links.pop(conn_id, None)
            self._link_metrics.pop(conn_id, None)
            link.close()

    async def _serve_frames(self, link: RecvLink, conn_id: int, told: set[str]) -> None:
        landing = Landing(link)  # data frames whose bodies land apart from the stream (ucx)
        while True:
            item = await link.next_frame()
            closed = isinstance(item, LinkClosed)
            if not closed and link.lands_apart(item):
                landing.add(item.header, functools.partial(self._on_data_apart, link, conn_id, item, told))
                continue
            try:
                if not landing.idle:
                    await landing.settle()  # every earlier frame is handled before this one
                if closed:
                    self._on_closed(conn_id, item.reason, item.partial, by_peer=link.closed_by_peer)
                    return
                await self._on_frame(link, conn_id, item, told)
            except (ConnectionError, FrameError, TransferError) as exc:
                failed = landing.failed_header or (None if closed else item.header)
                self._on_closed(conn_id, str(exc), failed, by_peer=False)
                return
            finally:
                if not closed:
                    link.release(item)

    def _on_closed(self, conn_id: int, reason: str, partial: FrameHeader | None, by_peer: bool) -> None:
        """Fail the connection's requests; their placements are fenced only if the peer ended the
        stream (it writes nothing more). When we close it, they wait out ``fence_timeout_s``."""
        if partial is not None:
            self._table.fail(partial.request_id, f"request {partial.request_id!r}: {reason}", conn_id)
        failed = self._table.fail_connection(conn_id, f"peer connection lost: {reason}")
        if by_peer:
            self._table.fence_connection(conn_id)
        if failed:
            logger.warning("transfer connection %d lost (%s); failed requests %s", conn_id, reason, failed)

    async def _on_frame(self, link: RecvLink, conn_id: int, frame: Frame, told: set[str]) -> None:
        header = frame.header
        if header.kind.is_data:
            await self._on_data(link, conn_id, frame, told)
        elif header.kind == Kind.END:
            reason = self._table.finish(header.request_id, header.layer, conn_id)
            if reason is None:
                link.reply(control_header(Kind.DONE, header.request_id))
            else:
                self._reject(link, header, reason, told)
        elif header.kind == Kind.ABORT:
            text = bytes(await link.read_body(frame)).decode(errors="replace")
            self._link_metrics[conn_id].aborted()
            self._table.fail(header.request_id, f"request {header.request_id!r} aborted by the sender: {text}")
            self._table.fence(header.request_id, conn_id)  # nothing is written after an ABORT
        elif header.kind == Kind.OPEN:
            self._on_open(link, conn_id, header.request_id)
        elif header.kind == Kind.REVOKED:
            self._table.fence(header.request_id, conn_id)
        elif header.kind == Kind.SYNC:  # frames are handled in order: all before it are done
            link.reply(control_header(Kind.SYNCED, "", seq=header.seq))
        else:
            raise FrameError(f"unexpected {header.describe()} from a sender")

    def _on_open(self, link: RecvLink, conn_id: int, request_id: str) -> None:
        """Answer OPEN with the request's placement (PLACE), or an empty PLACE: use the ring."""
        sink = self._table.open(request_id, conn_id) if link.supports_placement else None
        place = getattr(sink, "placement", None)
        local = place() if place is not None else None
        payload = b""
        if local is not None and self._table.placed(request_id, conn_id, local):
            payload = local.placement.pack()
        link.reply(control_header(Kind.PLACE, request_id, payload=payload), payload)

    async def _on_data_apart(
        self, link: RecvLink, conn_id: int, frame: Frame, told: set[str], before: Awaitable[None] | None
    ) -> None:
        """A data frame of the landing chain: handled as any other, acknowledged after ``before``."""
        try:
            await self._on_data(link, conn_id, frame, told, before)
        finally:
            link.release(frame)

    async def _on_data(
        self, link: RecvLink, conn_id: int, frame: Frame, told: set[str], before: Awaitable[None] | None = None
    ) -> None:
        """Admit, receive, verify and count a data frame; its ACK waits for ``before`` (the
        frame ahead of it in the landing chain, ``landing``), since an ACK covers every frame
        up to it."""
        header = frame.header
        self.frames_received += 1
        self.bytes_received += header.body_bytes
        metrics = self._link_metrics[conn_id]
        metrics.frame(header.body_bytes)
        if header.flags & FLAG_DIRECT:
            self.frames_direct += 1
            reason = self._verify_in_place(header, conn_id, metrics)
        else:
            sink, reason = self._table.admit(header, conn_id)
            if sink is None:
                await link.read_data(frame, None)  # always consume the body, even to drop it
            else:
                try:
                    reason = await self._deliver(link, frame, sink, metrics)
                finally:
                    self._table.landed(header.request_id)
        if reason is not None:
            self.frames_rejected += 1
            self._reject(link, header, reason, told)
        if before is not None:
            await before
        link.ack(header.seq)

    async def _deliver(self, link: RecvLink, frame: Frame, sink: Sink, metrics: ProcessLink) -> str | None:
        """Receive the body, verify it and hand it to the sink; returns why it failed, or None.

        A sink with ``views`` (``base.ViewSink``) gets the body received straight into its
        destination, checksummed as it lands; any other sink gets ``write`` of a verified copy."""
        header = frame.header
        try:
            views = _views_of(sink, header)
        except ValueError as exc:
            await link.read_data(frame, None)
            reason = f"destination rejected {header.describe()}: {exc}"
        else:
            body, actual, expected = await link.read_data(frame, views)
            reason = self._accept(sink, views, body, header, (actual, expected), metrics)
            if reason is None:
                return None
        self._table.fail(header.request_id, reason)
        return reason

    def _accept(
        self, sink: Sink, views: list | None, body: memoryview, header: FrameHeader, checksums: tuple[int, int],
        metrics: ProcessLink,
    ) -> str | None:
        """Count a received body whose checksums are ``(actual, expected)`` (written by ``sink``
        first unless it already lies in ``views``); returns why it failed, or None."""
        actual, expected = checksums
        if actual != expected:
            metrics.checksum_failure()
            return _mismatch(header, expected, actual)
        if views is None:
            try:
                sink.write(header.kind, header.layer, header.token_start, header.token_end, as_tensor(body, header))
            except ValueError as exc:
                return f"destination rejected {header.describe()}: {exc}"
        self._table.record(header)
        return None

    def _verify_in_place(self, header: FrameHeader, conn_id: int, metrics: ProcessLink) -> str | None:
        """Check a chunk the peer wrote into the destination: the receiver's own placement says
        where it lies; its checksum there must match. Returns why it failed, or None."""
        local, reason = self._table.admit_direct(header, conn_id)
        if local is None:
            return reason  # nothing of a misfit or failed request is read (its memory may be reused)
        segments = local.placement.segments(header.kind, header.layer, header.token_start, header.token_end)
        if segments is None or sum(n for _, _, n in segments) != header.body_bytes:
            reason = f"rejected {header.describe()}: written directly, but the placement has no such destination"
        else:
            actual = checksum_of(header.checksum_algo, local.views_of(segments))
            if actual == header.body_checksum:
                self._table.record(header)
                return None
            metrics.checksum_failure()
            reason = _mismatch(header, header.body_checksum, actual) + " (written directly into the destination)"
        self._table.fail(header.request_id, reason)
        return reason

    def _reject(self, link: RecvLink, header: FrameHeader, reason: str, told: set[str]) -> None:
        if header.request_id in told:
            return
        told.add(header.request_id)
        logger.warning("transfer rejected: %s", reason)
        payload = reason.encode()[:MAX_REASON_BYTES]
        link.reply(control_header(Kind.ERROR, header.request_id, payload=payload), payload)


def _views_of(sink: Sink, header: FrameHeader) -> list | None:
    """The destination views a ``ViewSink`` gives for the chunk, checked to hold its body
    exactly; None for a sink without them. ValueError when the sink has no such destination."""
    views = getattr(sink, "views", None)
    if views is None:
        return None
    found = views(header.kind, header.layer, header.token_start, header.token_end)
    if found is not None and sum(len(v) for v in found) != header.body_bytes:
        raise ValueError(f"its destination holds {sum(len(v) for v in found)} bytes, the chunk {header.body_bytes}")
    return found


def _mismatch(header: FrameHeader, expected: int, actual: int) -> str:
    return (
        f"checksum mismatch in {header.describe()}: the sender says {expected:#010x}, "
        f"body hashes to {actual:#010x} ({header.checksum_algo.name.lower()}); corrupted in transit"
    )
