"""Receiver: accepts sender connections on one or more backends, verifies every chunk and
writes it into the destination of the request it belongs to.

Threads: all connection handling, checksum verification and ``sink.write`` calls run on the
I/O thread (``ioloop.IoThread``), one connection's frames strictly in order. Caller threads
use ``expect``/``wait_layer``/``wait_complete``/``cancel``, which go through the locked
``stream.RequestTable``; never call the blocking waits from the I/O thread.

Rejection policy: a chunk for a request that was never ``expect``-ed (or was cancelled,
completed or failed) is read, dropped, acknowledged (so the sender's in-flight bytes drain),
logged once, and answered with an ERROR frame naming the reason; the sender fails that request.
Any later failure of a request (checksum, misfit, sink rejection, deadline, cancel) is also
sent back as an ERROR on its connection. Frames are acknowledged (cumulatively) only after the
sink has copied them, so the sender's ``max_inflight_bytes`` also bounds what waits here.

The I/O thread is shared by every sender and receiver of the process (unless one is given), so
a slow ``sink.write`` delays them all: sinks should copy and return.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence

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
from kvstore.transfer.frames import FrameError, FrameHeader, Kind, checksum, control_header
from kvstore.transfer.ioloop import IoThread
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
        self._table = RequestTable(clock, on_fail=self._on_request_failed)
        self._links: dict[int, RecvLink] = {}  # I/O thread only
        self._conn_ids = itertools.count(1)
        self.frames_received = 0
        self.bytes_received = 0
        self.frames_rejected = 0
        schemes = [backends] if isinstance(backends, str) else list(backends)
        self._listeners = {
            scheme: self._io.run(
                get_backend(scheme).listen(self.config, self._serve_link), self.config.connect_timeout_s
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

    async def _serve_link(self, link: RecvLink) -> None:
        conn_id = next(self._conn_ids)
        self._links[conn_id] = link
        told: set[str] = set()
        try:
            await self._serve_frames(link, conn_id, told)
        except Exception:  # outermost boundary of this connection's task
            logger.exception("transfer connection %d failed", conn_id)
            self._table.fail_connection(conn_id, "receiver error on its connection (see receiver log)")
        finally:
            self._links.pop(conn_id, None)
            link.close()

    async def _serve_frames(self, link: RecvLink, conn_id: int, told: set[str]) -> None:
        while True:
            item = await link.next_frame()
            if isinstance(item, LinkClosed):
                self._on_closed(conn_id, item.reason, item.partial)
                return
            try:
                await self._on_frame(link, conn_id, item, told)
            except (ConnectionError, FrameError, TransferError) as exc:
                self._on_closed(conn_id, str(exc), item.header)
                return
            finally:
                link.release(item)

    def _on_closed(self, conn_id: int, reason: str, partial: FrameHeader | None) -> None:
        if partial is not None:
            self._table.fail(partial.request_id, f"request {partial.request_id!r}: {reason}")
        failed = self._table.fail_connection(conn_id, f"peer connection lost: {reason}")
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
            self._table.fail(header.request_id, f"request {header.request_id!r} aborted by the sender: {text}")
        else:
            raise FrameError(f"unexpected {header.describe()} from a sender")

    async def _on_data(self, link: RecvLink, conn_id: int, frame: Frame, told: set[str]) -> None:
        header = frame.header
        body = await link.read_body(frame)  # always consume the body, even to drop it
        self.frames_received += 1
        self.bytes_received += header.body_bytes
        sink, reason = self._table.admit(header, conn_id)
        if sink is not None:
            reason = self._deliver(sink, body, header)
        if reason is not None:
            self.frames_rejected += 1
            self._reject(link, header, reason, told)
        link.ack(header.seq)

    def _deliver(self, sink: Sink, body: memoryview, header: FrameHeader) -> str | None:
        """Verify the body and hand it to the sink; returns why it failed, or None."""
        actual = checksum(header.checksum_algo, body)
        if actual != header.body_checksum:
            reason = (
                f"checksum mismatch in {header.describe()}: header says {header.body_checksum:#010x}, "
                f"body hashes to {actual:#010x} ({header.checksum_algo.name.lower()}); corrupted in transit"
            )
        else:
            try:
                sink.write(header.kind, header.layer, header.token_start, header.token_end, as_tensor(body, header))
            except ValueError as exc:
                reason = f"destination rejected {header.describe()}: {exc}"
            else:
                self._table.record(header)
                return None
        self._table.fail(header.request_id, reason)
        return reason

    def _reject(self, link: RecvLink, header: FrameHeader, reason: str, told: set[str]) -> None:
        if header.request_id in told:
            return
        told.add(header.request_id)
        logger.warning("transfer rejected: %s", reason)
        payload = reason.encode()[:MAX_REASON_BYTES]
        link.reply(control_header(Kind.ERROR, header.request_id, payload=payload), payload)
