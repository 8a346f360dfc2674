"""Frames over a byte stream (TCP or unix socket), shared by every backend.

``FrameConnection`` is an ``asyncio.BufferedProtocol``: the kernel copies headers into a 64 KiB
read area (a batch of small frames' headers arrives in one read) and the rest of an inline body
straight into its buffer (no ``readexactly`` copies, no per-byte Python). A control frame's
small body goes into a reusable staging buffer before the frame is delivered. With
``defer_data_bodies`` (the tcp receiver) a data frame is delivered as soon as its header is
parsed, and its consumer says where the body goes (``receive_into``): straight into the
destination pages, checksummed piece by piece as each recv lands (while the bytes are in
cache), with no staging copy::

    header parsed ─► Frame(header, None) ─► consumer admits it, finds the destination views
                                       ─► receive_into(views): recv_into views[0][..512 KiB],
                                          crc(piece), ... views[-1] ─► checksum ─► release()

While the consumer holds a frame (its body unread, or an inline body in use) the connection
stops reading and parsing, so one staging buffer per connection suffices. Writes go out with
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
from kvstore.transfer.direct import copy_with_checksum
from kvstore.transfer.frames import (
    FLAG_INLINE_BODY,
    HEADER_BYTES,
    ChecksumAlgo,
    FrameError,
    FrameHeader,
    Kind,
    checksum,
    control_header,
    unpack_header,
)

logger = logging.getLogger(__name__)
READ_AREA_BYTES = 64 << 10
RECV_PIECE_BYTES = 512 << 10  # at most this per recv into a body: checksummed while it is in L2
SMALL_PIECE_BYTES = 64 << 10  # checksummed without releasing the GIL (a hand-off costs more)


class FrameConnection(asyncio.BufferedProtocol):
    """One stream carrying frames both ways; incoming frames queue for ``next_frame``."""

    def __init__(
        self,
        max_frame_bytes: int,
        on_connected: Callable[[FrameConnection], None] | None = None,
        defer_data_bodies: bool = False,
    ):
        self._max_frame_bytes = max_frame_bytes
        self._on_connected = on_connected
        self._defer_data_bodies = defer_data_bodies
        self._frames: asyncio.Queue[Frame | LinkClosed] = asyncio.Queue()
        # Headers (and the first bytes of a body) land in the read area; several headers can
        # arrive in one read: [parsed | area_start .. unparsed .. area_end | free]
        self._area = bytearray(READ_AREA_BYTES)
        self._area_view = memoryview(self._area)
        self._area_start = 0
        self._area_end = 0
        self._staging = bytearray(0)
        self._body_header: FrameHeader | None = None  # set while a body is being read
        self._filled_bytes = 0  # body bytes of _body_header read so far
        # Where the body being read goes, in order (the staging buffer, or a consumer's views),
        # and the checksum of what has landed (deferred data bodies only).
        self._targets: list[memoryview] = []
        self._target_index = 0
        self._target_filled = 0
        self._algo: ChecksumAlgo | None = None
        self._crc = 0
        self._body_done: asyncio.Future[int] | None = None
        self._deferred: FrameHeader | None = None  # a delivered data frame whose body is unread
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
        if self._body_header is not None:  # the rest of a body goes straight into its target
            start = self._target_filled
            return self._targets[self._target_index][start : start + RECV_PIECE_BYTES]
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
        self._landed(nbytes)

    def _landed(self, nbytes: int) -> None:
        """``nbytes`` more of the body are in the current target: checksum them, move on."""
        target = self._targets[self._target_index]
        if self._algo is not None:
            piece = target[self._target_filled : self._target_filled + nbytes]
            self._crc = checksum(self._algo, piece, self._crc, hold_gil=nbytes <= SMALL_PIECE_BYTES)
        self._target_filled += nbytes
        self._filled_bytes += nbytes
        if self._target_filled == len(target):
            self._target_index += 1
            self._target_filled = 0
        if self._filled_bytes == self._body_header.body_bytes:
            self._body_complete()

    def _body_complete(self) -> None:
        header, self._body_header = self._body_header, None
        self._filled_bytes = 0
        self._holding = True
        self.transport.pause_reading()
        done, self._body_done = self._body_done, None
        if done is None:  # a staged control body: the frame is delivered with it
            self._frames.put_nowait(Frame(header, self._targets[0] if self._targets else memoryview(b"")))
        elif not done.done():
            done.set_result(self._crc)

    def _parse(self) -> None:
        """Turn every complete header in the read area into a frame, until a body must be read
        or held."""
        while not self._holding and self._body_header is None and not self.closed.is_set():
            if self._area_end - self._area_start < HEADER_BYTES:
                return
            start = self._area_start
            self._area_start += HEADER_BYTES
            self._on_header(self._area_view[start : start + HEADER_BYTES])
            if self._body_header is not None:  # a staged body: its first bytes may sit behind the header
                self._take_from_area()

    def _take_from_area(self) -> None:
        """Move body bytes already in the read area into the targets, as if they had just landed."""
        while self._body_header is not None and self._area_start < self._area_end:
            target = self._targets[self._target_index]
            take = min(self._area_end - self._area_start, len(target) - self._target_filled)
            target[self._target_filled : self._target_filled + take] = self._area_view[
                self._area_start : self._area_start + take
            ]
            self._area_start += take
            self._landed(take)

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
        if self._defer_data_bodies and header.kind.is_data:
            # The consumer decides where the body goes (``receive_into``); hold until it does.
            self._deferred = header
            self._holding = True
            self.transport.pause_reading()
            self._frames.put_nowait(Frame(header, None))
            return
        self._start_body(header, [self._staging_view(header.body_bytes)], None)

    def _staging_view(self, nbytes: int) -> memoryview:
        if len(self._staging) < nbytes:
            # A new buffer, not a resize: views of the old one may still be alive.
            self._staging = bytearray(min(self._max_frame_bytes, max(nbytes, 2 * len(self._staging))))
        return memoryview(self._staging)[:nbytes]

    def _start_body(self, header: FrameHeader, targets: list[memoryview], algo: ChecksumAlgo | None) -> None:
        self._body_header = header
        self._targets = [t for t in targets if len(t)]
        self._target_index = self._target_filled = self._filled_bytes = 0
        self._algo = algo
        self._crc = 0
        if header.body_bytes == 0:
            self._body_complete()

    async def receive_into(self, header: FrameHeader, targets: Sequence[memoryview] | None) -> tuple[memoryview, int]:
        """Read the body of the deferred data frame ``header`` into ``targets`` (writable byte
        views whose lengths add up to its ``body_bytes``, filled in order; None: a staging
        buffer of the connection's). Returns the buffer it went into (the staging view, or an
        empty view for targets) and the body's checksum under the header's algorithm, computed
        as each piece landed. ``ConnectionError`` when the stream ends first. The frame is
        still held afterwards: ``release`` it."""
        if self._deferred is None or self._deferred is not header:
            raise FrameError(f"{header.describe()}: its body is not the next on this connection")
        if self.closed.is_set():
            raise ConnectionError(self.closed_reason)
        self._deferred = None
        staged = targets is None
        views = [self._staging_view(header.body_bytes)] if staged else list(targets)
        if sum(len(v) for v in views) != header.body_bytes:
            raise ValueError(f"{header.describe()}: targets hold {sum(len(v) for v in views)} bytes, not "
                             f"{header.body_bytes}")
        self._body_done = done = asyncio.get_running_loop().create_future()
        self._start_body(header, views, header.checksum_algo)
        self._take_from_area()
        if self._body_header is not None:  # more to come from the socket
            self._holding = False
            self.transport.resume_reading()
        crc = await done
        return (views[0] if staged else memoryview(b"")), crc

    def limit_body_bytes(self, max_body_bytes: int) -> None:
        """Largest inline body accepted from now on (a larger one fails the connection); the
        auth handshake keeps it tiny until the peer has authenticated, so an unauthenticated
        peer cannot make us allocate a frame's staging buffer."""
        self._max_frame_bytes = max_body_bytes

    def release(self) -> None:
        """The consumer is done with the last frame it held; parse what was read behind it, resume.
        A deferred body nobody read leaves the stream out of step: the connection fails."""
        if self._deferred is not None:
            header, self._deferred = self._deferred, None
            self._fail(f"{header.describe()}: its body was never read (receiver bug)")
            return
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
        elif self._area_end > self._area_start and self._deferred is None:
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
        done, self._body_done = self._body_done, None
        if done is not None and not done.done():
            done.set_exception(ConnectionError(reason))
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


def land(header: FrameHeader, body, targets: list | None) -> tuple[memoryview, int]:
    """A body that is already in memory (a ring slot, a UCX buffer, a staged frame) handed on as
    ``RecvLink.read_data`` does: into ``targets`` with the checksum computed block by block
    while copying (``direct.copy_with_checksum``), or as it is with its checksum."""
    if targets is None:
        return memoryview(body), checksum(header.checksum_algo, body)
    if not header.body_bytes:
        return memoryview(b""), checksum(header.checksum_algo, b"")
    return memoryview(b""), copy_with_checksum(header.checksum_algo, [memoryview(body)], targets)


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
    """Receiver end of a stream link; bodies ride inline (the TCP backend as is). Data bodies
    are deferred (``FrameConnection.receive_into``) when the connection was made so."""

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
        """The inline body of a control frame (a reason, a handshake)."""
        if frame.header.body_bytes and frame.inline is None:
            raise FrameError(f"{frame.header.describe()}: expected an inline body on this link")
        return frame.inline if frame.inline is not None else memoryview(b"")

    async def read_data(self, frame: Frame, targets: list | None) -> tuple[memoryview, int]:
        """The body of a data frame, received into ``targets`` (writable uint8 arrays in body
        order, adding up to its ``body_bytes``) or, when None, into a buffer of the link's
        (valid until ``release``). Returns that buffer (empty for targets) and the body's
        checksum under its header's algorithm, computed as it landed. ConnectionError if
        the stream ends first."""
        header = frame.header
        if frame.inline is not None:  # read before the connection deferred data bodies (the handshake)
            return land(header, frame.inline, targets)
        if not header.inline_body:
            if header.body_bytes:
                raise FrameError(f"{header.describe()}: expected an inline body on this link")
            return land(header, memoryview(b""), targets)
        return await self.conn.receive_into(header, targets)

    def release(self, frame: Frame) -> None:
        if frame.inline is not None or (frame.header.kind.is_data and frame.header.inline_body):
            self.conn.release()

    def reply(self, header: FrameHeader, payload: bytes = b"") -> None:
        self._flush_ack()
        self._write(header, payload)

    def _write(self, header: FrameHeader, payload: bytes) -> None:
        if not self.conn.closed.is_set() and not self.conn.transport.is_closing():
            self.conn.transport.writelines((header.pack(), payload))

    def close(self) -> None:
        self.conn.close()
