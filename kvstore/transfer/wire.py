"""Frames over a byte stream (TCP or unix socket), shared by every backend.

``FrameConnection`` is an ``asyncio.BufferedProtocol``: the kernel copies headers into a 64 KiB
read area (a batch of small frames' headers arrives in one read) and the rest of an inline body
straight into a reusable staging buffer (no ``readexactly`` copies, no per-byte Python).
While the consumer holds an inline body the connection stops reading and parsing, so one
staging buffer per connection suffices. Writes go out with
``writelines([header, body])`` from the caller's memoryview (zero-copy) and wait on the
transport's flow control. ``StreamSendLink`` / ``StreamRecvLink`` implement the link
protocols of ``base.py`` with inline bodies; shm and ucx override only the body path.

Everything here runs on the I/O loop thread; nothing is locked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from kvstore.transfer.base import Frame, LinkClosed
from kvstore.transfer.frames import (
    FLAG_INLINE_BODY,
    HEADER_BYTES,
    FrameError,
    FrameHeader,
    Kind,
    checksum,
    control_header,
    unpack_header,
)

logger = logging.getLogger(__name__)
READ_AREA_BYTES = 64 << 10


class FrameConnection(asyncio.BufferedProtocol):
    """One stream carrying frames both ways; incoming frames queue for ``next_frame``."""

    def __init__(self, max_frame_bytes: int, on_connected: Callable[[FrameConnection], None] | None = None):
        self._max_frame_bytes = max_frame_bytes
        self._on_connected = on_connected
        self._frames: asyncio.Queue[Frame | LinkClosed] = asyncio.Queue()
        # Headers (and the first bytes of a body) land in the read area; several headers can
        # arrive in one read: [parsed | area_start .. unparsed .. area_end | free]
        self._area = bytearray(READ_AREA_BYTES)
        self._area_view = memoryview(self._area)
        self._area_start = 0
        self._area_end = 0
        self._staging = bytearray(0)
        self._body_view = memoryview(self._staging)
        self._body_header: FrameHeader | None = None  # set while a body is being read
        self._filled_bytes = 0  # body bytes of _body_header already in _body_view
        self._holding = False
        self._write_ready = asyncio.Event()
        self._write_ready.set()
        self.made = asyncio.Event()  # set by connection_made, which may run after create_connection returns
        self.closed = asyncio.Event()
        self.closed_reason = ""
        self.closed_by_peer = False  # the peer ended the stream (EOF, reset or death), not we
        self._closing = False  # we closed or aborted the transport
        self._eof_sent = False
        self.transport: asyncio.Transport | None = None

    # ---- incoming --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # uvloop's transports do not subclass asyncio.Transport
        self.made.set()
        if self._on_connected is not None:
            self._on_connected(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body_header is not None:  # the rest of a body goes straight into its buffer
            return self._body_view[self._filled_bytes :]
        if self._area_start == self._area_end:
            self._area_start = self._area_end = 0
        elif len(self._area) - self._area_end < HEADER_BYTES:  # compact a partial header to the front
            pending = self._area_end - self._area_start
            self._area[:pending] = self._area[self._area_start : self._area_end]
            self._area_start, self._area_end = 0, pending
        return self._area_view[self._area_end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._body_header is None:
            self._area_end += nbytes
            self._parse()
            return
        self._filled_bytes += nbytes
        if self._filled_bytes == len(self._body_view):
            self._deliver_body()

    def _parse(self) -> None:
        """Turn every complete header in the read area into a frame, until an inline body must
        be read or held."""
        while not self._holding and self._body_header is None and not self.closed.is_set():
            if self._area_end - self._area_start < HEADER_BYTES:
                return
            start = self._area_start
            self._area_start += HEADER_BYTES
            self._on_header(self._area_view[start : start + HEADER_BYTES])
            if self._body_header is not None:  # body bytes already read sit behind the header
                take = min(self._area_end - self._area_start, len(self._body_view))
                self._body_view[:take] = self._area_view[self._area_start : self._area_start + take]
                self._area_start += take
                self._filled_bytes = take
                if take == len(self._body_view):
                    self._deliver_body()

    def _deliver_body(self) -> None:
        frame = Frame(self._body_header, self._body_view)
        self._body_header = None
        self._filled_bytes = 0
        self._holding = True
        self.transport.pause_reading()
        self._frames.put_nowait(frame)

    def _on_header(self, raw: memoryview) -> None:
        try:
            header = unpack_header(raw)
        except FrameError as exc:
            self._fail(f"protocol error: {exc}")
            return
        if not header.inline_body:
            self._frames.put_nowait(Frame(header, None))
            return
        if header.body_bytes > self._max_frame_bytes:
            self._fail(
                f"{header.describe()}: body of {header.body_bytes} bytes exceeds max_frame_bytes "
                f"{self._max_frame_bytes}"
            )
            return
        if len(self._staging) < header.body_bytes:
            # A new buffer, not a resize: views of the old one may still be alive.
            self._staging = bytearray(min(self._max_frame_bytes, max(header.body_bytes, 2 * len(self._staging))))
        self._body_view = memoryview(self._staging)[: header.body_bytes]
        self._body_header = header

    def limit_body_bytes(self, max_body_bytes: int) -> None:
        """Largest inline body accepted from now on (a larger one fails the connection); the
        auth handshake keeps it tiny until the peer has authenticated, so an unauthenticated
        peer cannot make us allocate a frame's staging buffer."""
        self._max_frame_bytes = max_body_bytes

    def release(self) -> None:
        """The consumer is done with the last inline body; parse what was read behind it, resume."""
        if self._holding:
            self._holding = False
            if not self.closed.is_set():
                self._parse()
                if not self._holding:
                    self.transport.resume_reading()

    async def next_frame(self) -> Frame | LinkClosed:
        return await self._frames.get()

    def eof_received(self) -> bool:
        if not self._closing:
            self.closed_by_peer = True
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed.is_set():
            return
        if not self._closing:
            self.closed_by_peer = True
        if self._body_header is not None:
            reason = (
                f"truncated frame: connection closed after {self._filled_bytes} of "
                f"{self._body_header.body_bytes} body bytes of {self._body_header.describe()}"
            )
        elif self._area_end > self._area_start:
            got = self._area_end - self._area_start
            reason = f"truncated frame: connection closed after {got} of {HEADER_BYTES} header bytes"
        else:
            reason = "connection closed by peer" + (f" ({exc})" if exc else "")
        self._mark_closed(reason, self._body_header)

    def _fail(self, reason: str) -> None:
        logger.warning("closing transfer connection: %s", reason)
        self._closing = True
        self._mark_closed(reason, None)
        self.transport.abort()

    def _mark_closed(self, reason: str, partial: FrameHeader | None) -> None:
        self.closed_reason = reason
        self.closed.set()
        self._write_ready.set()
        self._frames.put_nowait(LinkClosed(reason, partial))

    # ---- outgoing --------------------------------------------------------------------------

    def pause_writing(self) -> None:
        self._write_ready.clear()

    def resume_writing(self) -> None:
        self._write_ready.set()

    async def write(self, *parts: bytes | memoryview) -> None:
        """Queue ``parts`` on the transport and wait while its write buffer is over the high mark."""
        if self.transport is None:
            await self.made.wait()
        if self.closed.is_set() or self.transport.is_closing():
            raise ConnectionError(self.closed_reason or "connection is closing")
        self.transport.writelines(parts)
        await self._write_ready.wait()
        if self.closed.is_set():
            raise ConnectionError(self.closed_reason)

    def write_eof(self) -> None:
        """Half-close: no more frames from us; replies can still arrive."""
        transport = self.transport
        if transport is not None and not transport.is_closing() and not self._eof_sent:
            self._eof_sent = True
            transport.write_eof()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._closing = True
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection at once: unsent writes are discarded, nothing more is read."""
        if self.transport is not None:
            self._closing = True
            self.transport.abort()


def seal(header: FrameHeader, parts: Sequence[memoryview], corrupt: bool) -> tuple[FrameHeader, Sequence[memoryview]]:
    """The header with the checksum of the body (``parts`` in order); with ``corrupt`` (fault
    injection) a copy of the body with one byte flipped after checksumming."""
    crc = 0
    for part in parts:
        crc = checksum(header.checksum_algo, part, crc)
    header = header._replace(body_checksum=crc)
    if corrupt:
        damaged = bytearray(b"".join(parts))
        damaged[len(damaged) // 2] ^= 0xFF
        parts = (memoryview(damaged),)
    return header, parts


def with_inline(header: FrameHeader) -> FrameHeader:
    return header._replace(flags=header.flags | FLAG_INLINE_BODY)


class StreamSendLink:
    """Sender end of a stream link; bodies ride inline (the TCP backend as is)."""

    coalesces = True  # the sender may hand it one frame made of several chunks' bodies

    def __init__(self, conn: FrameConnection):
        self.conn = conn

    async def send_data(self, header: FrameHeader, parts: Sequence[memoryview], corrupt: bool = False) -> None:
        """Checksum the body (``parts`` in order) and send it inline, zero-copy (``corrupt``:
        damage it after checksumming)."""
        header, parts = seal(header, parts, corrupt)
        await self.conn.write(with_inline(header).pack(), *parts)

    async def flush(self) -> None:
        """Write out anything the link batches; the sender calls it whenever its queue is empty."""

    async def send_control(self, header: FrameHeader, payload: bytes) -> None:
        await self.conn.write(header.pack(), payload)

    async def send_truncated(self, header: FrameHeader, body: memoryview) -> None:
        """Fault injection: half the body, then end the stream (FIN, not RST: the bytes arrive)."""
        await self.conn.write(with_inline(header).pack(), body[: len(body) // 2])
        self.conn.write_eof()

    async def shutdown(self, timeout_s: float) -> None:
        """Graceful close: end our stream, wait for the peer to close its side, then close.

        Closing with unread replies in the socket would send an RST, and an RST can destroy
        frames the receiver has not read yet; the half-close lets it consume everything first.
        """
        self.conn.write_eof()
        try:
            async with asyncio.timeout(timeout_s):
                await self.conn.closed.wait()
        except TimeoutError:
            logger.warning("transfer peer did not close within %.1f s; closing anyway", timeout_s)
        self.close()

    async def next_reply(self) -> Frame | LinkClosed:
        """Next reply frame; its inline payload is copied so the stream can move on."""
        item = await self.conn.next_frame()
        if isinstance(item, Frame) and item.inline is not None:
            item = Frame(item.header, memoryview(bytes(item.inline)))
            self.conn.release()
        return item

    def on_ack(self, seq: int) -> None:
        """The receiver consumed frame ``seq``; inline bodies hold no sender resources."""

    def close(self) -> None:
        self.conn.close()


class StreamRecvLink:
    """Receiver end of a stream link; bodies ride inline (the TCP backend as is)."""

    supports_placement = False

    def __init__(self, conn: FrameConnection):
        self.conn = conn
        self._ack_seq = 0  # highest consumed data frame not yet acknowledged; 0 = none pending

    @property
    def closed_by_peer(self) -> bool:
        return self.conn.closed_by_peer

    async def next_frame(self) -> Frame | LinkClosed:
        return await self.conn.next_frame()

    def ack(self, seq: int) -> None:
        """Acknowledge every data frame up to ``seq`` (cumulative: frames are consumed in order).

        Coalesced: one ACK goes out when the loop next runs, or before any other reply, so a
        burst of queued frames costs one write and one wakeup of the sender.
        """
        if not self._ack_seq:
            asyncio.get_running_loop().call_soon(self._flush_ack)
        self._ack_seq = seq

    def _flush_ack(self) -> None:
        if self._ack_seq:
            seq, self._ack_seq = self._ack_seq, 0
            self._write(control_header(Kind.ACK, "", seq=seq), b"")

    async def read_body(self, frame: Frame) -> memoryview:
        if frame.header.body_bytes and frame.inline is None:
            raise FrameError(f"{frame.header.describe()}: expected an inline body on this link")
        return frame.inline if frame.inline is not None else memoryview(b"")

    def release(self, frame: Frame) -> None:
        if frame.inline is not None:
            self.conn.release()

    def reply(self, header: FrameHeader, payload: bytes = b"") -> None:
        self._flush_ack()
        self._write(header, payload)

    def _write(self, header: FrameHeader, payload: bytes) -> None:
        if not self.conn.closed.is_set() and not self.conn.transport.is_closing():
            self.conn.transport.writelines((header.pack(), payload))

    def close(self) -> None:
        self.conn.close()
