"""``FrameConnection``: frames over one byte stream (TCP or unix socket), both ways; every
backend's links (``wire``, ``shm``, ``ucx``) sit on it.

It is an ``asyncio.BufferedProtocol``: the kernel copies headers into a 64 KiB read area (a
batch of small frames' headers arrives in one read) and the rest of an inline body straight
into its buffer (no ``readexactly`` copies, no per-byte Python). A control frame's small body
goes into a reusable staging buffer before the frame is delivered. With ``defer_data_bodies``
(the tcp receiver) a data frame is delivered as soon as its header is parsed, and its consumer
says where the body goes (``receive_into``): straight into the destination pages, checksummed
piece by piece as each recv lands (while the bytes are in cache), with no staging copy::

    header parsed ─► Frame(header, None) ─► consumer admits it, finds the destination views
                                       ─► receive_into(views): recv_into views[0][..512 KiB],
                                          crc(piece), ... views[-1] ─► checksum ─► release()

Encrypted (``set_receive_cipher`` / ``set_send_cipher``, switched on by the handshake of
``auth`` on tcp links with ``TransferConfig.encrypt``; layout in ``aead``): each header is
read as 176 sealed bytes and opened; a body's ciphertext lands, a piece at a time, in a small
cipher buffer and is decrypted from there straight into its targets; its tag is checked after
the last piece. A header or body that fails authentication fails the connection (``_fail``),
and so every request on it; writes are then sealed (``writer``).

While the consumer holds a frame (its body unread, or an inline body in use) the connection
stops reading and parsing, so one staging buffer per connection suffices. The connection owns
the stream: its read area, staging and cipher buffers, headers, holding and delivery, and its
end; and two parts it delegates to: ``body.IncomingBody``, the body being read (where it lands,
its checksum, its decryption and tag), and ``writer.FrameWriter``, the send side (writes,
checksummed and sealed bodies, the wait on flow control), whose writing methods it takes as
its own. Everything here runs on the I/O loop thread; nothing is locked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from cryptography.exceptions import InvalidTag

from kvstore.transfer.aead import SEALED_HEADER_BYTES, TAG_BYTES, Direction
from kvstore.transfer.base import Frame, LinkClosed
from kvstore.transfer.body import RECV_PIECE_BYTES, IncomingBody
from kvstore.transfer.frames import (
    FLAG_TRAILING_CHECKSUM,
    HEADER_BYTES,
    TRAILER,
    ChecksumAlgo,
    FrameError,
    FrameHeader,
    unpack_header,
)
from kvstore.transfer.writer import FrameWriter

logger = logging.getLogger(__name__)
READ_AREA_BYTES = 64 << 10


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
        # The body being read: where it lands, its checksum and decryption (``body``).
        self._body = IncomingBody(self)
        self._body_done: asyncio.Future[tuple[int, int]] | None = None
        self._deferred: FrameHeader | None = None  # a delivered data frame whose body is unread
        self._holding = False
        # Encryption (see the module docstring): a sealed body's ciphertext lands here first.
        self._recv_cipher: Direction | None = None
        self._cipher_buffer: memoryview | None = None
        self._write_ready = asyncio.Event()  # flow control (``pause_writing``): the writer waits on it
        self._write_ready.set()
        self.made = asyncio.Event()  # set by connection_made, which may run after create_connection returns
        self.closed = asyncio.Event()
        self.closed_reason = ""
        self.closed_by_peer = False  # the peer ended the stream (EOF, reset or death), not we
        self._closing = False  # we closed or aborted the transport
        self.transport: asyncio.Transport | None = None
        # The send side; its methods are bound here once, so a write costs no call more.
        self._writer = writer = FrameWriter(self, self._write_ready)
        self.write = writer.write
        self.write_frame = writer.write_frame
        self.write_checked_frame = writer.write_checked_frame
        self.write_frame_nowait = writer.write_frame_nowait
        self.write_eof = writer.write_eof

    @property
    def encrypted(self) -> bool:
        return self._writer.cipher is not None

    def set_receive_cipher(self, direction: Direction) -> None:
        """Everything read from now on is sealed by the peer under ``direction``'s key."""
        self._recv_cipher = direction
        self._cipher_buffer = memoryview(bytearray(RECV_PIECE_BYTES))

    def set_send_cipher(self, direction: Direction) -> None:
        """Everything written from now on is sealed under ``direction``'s key (``write_frame``)."""
        self._writer.set_cipher(direction)

    # ---- incoming --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # uvloop's transports do not subclass asyncio.Transport
        self._writer.connected(transport)
        self.made.set()
        if self._on_connected is not None:
            self._on_connected(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        body = self._body
        if body.header is not None:  # the rest of a body goes straight into its target
            if self._recv_cipher is not None:  # ciphertext first into the cipher buffer
                return self._cipher_buffer[: min(body.cipher_left + TAG_BYTES - body.tag_filled, RECV_PIECE_BYTES)]
            start = body.filled
            return body.targets[body.index][start : start + RECV_PIECE_BYTES]
        if self._area_start == self._area_end:
            self._area_start = self._area_end = 0
        elif len(self._area) - self._area_end < SEALED_HEADER_BYTES:  # compact a partial header to the front
            pending = self._area_end - self._area_start
            self._area[:pending] = self._area[self._area_start : self._area_end]
            self._area_start, self._area_end = 0, pending
        return self._area_view[self._area_end :]

    def buffer_updated(self, nbytes: int) -> None:
        body = self._body
        if body.header is None:
            self._area_end += nbytes
            self._parse()
        elif self._recv_cipher is not None:
            body.open(self._cipher_buffer[:nbytes])
        elif body.landed(nbytes):
            self._body_complete()

    def _body_complete(self) -> None:
        body = self._body
        header, body.header = body.header, None  # ends the body (see ``body``'s docstring)
        body.filled_bytes = 0
        body.decryptor = None
        self._holding = True
        self.transport.pause_reading()
        done, self._body_done = self._body_done, None
        if done is None:  # a staged control body: the frame is delivered with it
            self._frames.put_nowait(Frame(header, body.targets[0] if body.targets else memoryview(b"")))
        elif not done.done():
            trailing = header.flags & FLAG_TRAILING_CHECKSUM
            done.set_result((body.crc, TRAILER.unpack(body.trailer)[0] if trailing else header.body_checksum))

    def _parse(self) -> None:
        """Turn every complete header in the read area into a frame, until a body must be read
        or held."""
        body = self._body
        while not self._holding and body.header is None and not self.closed.is_set():
            unit = HEADER_BYTES if self._recv_cipher is None else SEALED_HEADER_BYTES
            if self._area_end - self._area_start < unit:
                return
            start = self._area_start
            self._area_start += unit
            raw = self._area_view[start : start + unit]
            if self._recv_cipher is not None:
                try:
                    raw = memoryview(self._recv_cipher.open(bytes(raw)))
                except InvalidTag:
                    self._fail("protocol error: a frame header failed authentication (tampered with or corrupted)")
                    return
            self._on_header(raw)
            if body.header is not None:  # a staged body: its first bytes may sit behind the header
                self._take_from_area()

    def _take_from_area(self) -> None:
        """Move body bytes already in the read area into the targets, as if they had just landed."""
        body = self._body
        if self._recv_cipher is not None:
            self._area_start += body.open(self._area_view[self._area_start : self._area_end])
            return
        while body.header is not None and self._area_start < self._area_end:
            target = body.targets[body.index]
            take = min(self._area_end - self._area_start, len(target) - body.filled)
            target[body.filled : body.filled + take] = self._area_view[self._area_start : self._area_start + take]
            self._area_start += take
            if body.landed(take):
                self._body_complete()

    def _on_header(self, raw: memoryview) -> None:
        try:
            header = unpack_header(raw)
        except FrameError as exc:
            self._fail(f"protocol error: {exc}")
            return
        if header.checksum_algo == ChecksumAlgo.AEAD and self._recv_cipher is None:
            self._fail(f"protocol error: {header.describe()} is checked by an AEAD tag, but this link is not encrypted")
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
        deferred = self._defer_data_bodies and header.kind.is_data
        if header.flags & FLAG_TRAILING_CHECKSUM and not deferred:
            self._fail(f"protocol error: {header.describe()} has a trailing checksum, which only a tcp receiver reads")
            return
        if deferred:
            # The consumer decides where the body goes (``receive_into``); hold until it does.
            self._deferred = header
            self._holding = True
            self.transport.pause_reading()
            self._frames.put_nowait(Frame(header, None))
            return
        self._body.start(header, [self._staging_view(header.body_bytes)], None, self._recv_cipher)

    def _staging_view(self, nbytes: int) -> memoryview:
        if len(self._staging) < nbytes:
            # A new buffer, not a resize: views of the old one may still be alive.
            self._staging = bytearray(min(self._max_frame_bytes, max(nbytes, 2 * len(self._staging))))
        return memoryview(self._staging)[:nbytes]

    async def receive_into(self, header: FrameHeader, targets: Sequence | None) -> tuple[memoryview, int, int]:
        """Read the body of the deferred data frame ``header`` into ``targets`` (writable byte
        buffers whose lengths add up to its ``body_bytes``, filled in order; None: a staging
        buffer of the connection's). Returns the buffer it went into (the staging view, or an
        empty view for targets), the body's checksum under the header's algorithm (0 for AEAD:
        the tag was checked), computed as each piece landed, and the checksum the sender gave
        (the header's, or its trailer's). ``ConnectionError`` when the stream ends first or the
        body fails authentication. The frame is still held afterwards: ``release`` it."""
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
        self._body.start(header, views, header.checksum_algo, self._recv_cipher)
        self._take_from_area()
        if self._body.header is not None:  # more to come from the socket
            self._holding = False
            self.transport.resume_reading()
        actual, expected = await done
        return (views[0] if staged else memoryview(b"")), actual, expected

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
        partial = self._body.header
        if partial is not None:
            reason = (
                f"truncated frame: connection closed after {self._body.filled_bytes} of "
                f"{partial.body_bytes} body bytes of {partial.describe()}"
            )
        elif self._area_end > self._area_start and self._deferred is None:
            got = self._area_end - self._area_start
            reason = f"truncated frame: connection closed after {got} of {HEADER_BYTES} header bytes"
        else:
            reason = "connection closed by peer" + (f" ({exc})" if exc else "")
        self._mark_closed(reason, partial)

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

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._closing = True
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection at once: unsent writes are discarded, nothing more is read."""
        if self.transport is not None:
            self._closing = True
            self.transport.abort()
