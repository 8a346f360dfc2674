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
and so every request on it. Writes are then whole frames (``write_frame``), sealed, a body
encrypted piece by piece just before each piece is written.

While the consumer holds a frame (its body unread, or an inline body in use) the connection
stops reading and parsing, so one staging buffer per connection suffices. Writes go out with
``writelines`` from the caller's memoryviews (zero-copy when plaintext) and wait on the
transport's flow control. Everything here runs on the I/O loop thread; nothing is locked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from cryptography.exceptions import InvalidTag

from kvstore.transfer.aead import SEALED_HEADER_BYTES, TAG_BYTES, Direction
from kvstore.transfer.base import Frame, LinkClosed
from kvstore.transfer.frames import (
    FLAG_TRAILING_CHECKSUM,
    HEADER_BYTES,
    TRAILER,
    ChecksumAlgo,
    FrameError,
    FrameHeader,
    checksum,
    unpack_header,
)

logger = logging.getLogger(__name__)
READ_AREA_BYTES = 64 << 10
RECV_PIECE_BYTES = 512 << 10  # at most this per recv into a body (or per sealed piece): in L2 still
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
        self._filled_bytes = 0  # body bytes of _body_header landed so far
        # Where the body being read goes, in order (the staging buffer, or a consumer's views),
        # and the checksum of what has landed (deferred data bodies only).
        self._targets: list = []
        self._body_targets = 0  # targets of the body proper; a trailing checksum's follows them
        self._expect_bytes = 0  # the body and its trailer
        self._trailer = bytearray(TRAILER.size)
        self._target_index = 0
        self._target_filled = 0
        self._algo: ChecksumAlgo | None = None
        self._crc = 0
        self._body_done: asyncio.Future[tuple[int, int]] | None = None
        self._deferred: FrameHeader | None = None  # a delivered data frame whose body is unread
        self._holding = False
        # Encryption (see the module docstring): what is still to come of the body being read.
        self._recv_cipher: Direction | None = None
        self._send_cipher: Direction | None = None
        self._cipher_buffer: memoryview | None = None
        self._decryptor = None
        self._cipher_left = 0
        self._tag = bytearray(TAG_BYTES)
        self._tag_filled = 0
        self._frame_writing = False  # an encrypted frame is being written piece by piece
        self._write_ready = asyncio.Event()
        self._write_ready.set()
        self.made = asyncio.Event()  # set by connection_made, which may run after create_connection returns
        self.closed = asyncio.Event()
        self.closed_reason = ""
        self.closed_by_peer = False  # the peer ended the stream (EOF, reset or death), not we
        self._closing = False  # we closed or aborted the transport
        self._eof_sent = False
        self.transport: asyncio.Transport | None = None

    @property
    def encrypted(self) -> bool:
        return self._send_cipher is not None

    def set_receive_cipher(self, direction: Direction) -> None:
        """Everything read from now on is sealed by the peer under ``direction``'s key."""
        self._recv_cipher = direction
        self._cipher_buffer = memoryview(bytearray(RECV_PIECE_BYTES))

    def set_send_cipher(self, direction: Direction) -> None:
        """Everything written from now on is sealed under ``direction``'s key (``write_frame``)."""
        self._send_cipher = direction

    # ---- incoming --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # uvloop's transports do not subclass asyncio.Transport
        self.made.set()
        if self._on_connected is not None:
            self._on_connected(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body_header is not None:  # the rest of a body goes straight into its target
            if self._recv_cipher is not None:  # ciphertext first into the cipher buffer
                return self._cipher_buffer[: min(self._cipher_left + TAG_BYTES - self._tag_filled, RECV_PIECE_BYTES)]
            start = self._target_filled
            return self._targets[self._target_index][start : start + RECV_PIECE_BYTES]
        if self._area_start == self._area_end:
            self._area_start = self._area_end = 0
        elif len(self._area) - self._area_end < SEALED_HEADER_BYTES:  # compact a partial header to the front
            pending = self._area_end - self._area_start
            self._area[:pending] = self._area[self._area_start : self._area_end]
            self._area_start, self._area_end = 0, pending
        return self._area_view[self._area_end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._body_header is None:
            self._area_end += nbytes
            self._parse()
        elif self._recv_cipher is not None:
            self._open_body(self._cipher_buffer[:nbytes])
        elif self._landed(nbytes):
            self._body_complete()

    def _landed(self, nbytes: int) -> bool:
        """``nbytes`` more of the body are in the current target: checksum them, move on; True
        once the whole body is in."""
        target = self._targets[self._target_index]
        if self._algo is not None and self._target_index < self._body_targets:
            piece = target[self._target_filled : self._target_filled + nbytes]
            self._crc = checksum(self._algo, piece, self._crc, hold_gil=nbytes <= SMALL_PIECE_BYTES)
        self._target_filled += nbytes
        self._filled_bytes += nbytes
        if self._target_filled == len(target):
            self._target_index += 1
            self._target_filled = 0
        return self._filled_bytes == self._expect_bytes

    def _open_body(self, data: memoryview) -> int:
        """Decrypt ciphertext of the body being read into its targets, then take its tag; returns
        how many bytes of ``data`` that used (the rest belongs to what follows)."""
        used = 0
        while used < len(data) and self._body_header is not None:
            if self._cipher_left:
                target = self._targets[self._target_index]
                take = min(len(data) - used, self._cipher_left, len(target) - self._target_filled)
                self._decryptor.update_into(
                    data[used : used + take], target[self._target_filled : self._target_filled + take]
                )
                self._cipher_left -= take
                used += take
                self._landed(take)
                continue
            take = min(len(data) - used, TAG_BYTES - self._tag_filled)
            self._tag[self._tag_filled : self._tag_filled + take] = data[used : used + take]
            self._tag_filled += take
            used += take
            if self._tag_filled == TAG_BYTES:
                try:
                    self._decryptor.finalize_with_tag(bytes(self._tag))
                except InvalidTag:
                    self._fail(f"protocol error: the body of {self._body_header.describe()} failed authentication "
                               "(tampered with or corrupted in transit)")
                    return used
                self._body_complete()
        return used

    def _body_complete(self) -> None:
        header, self._body_header = self._body_header, None
        self._filled_bytes = 0
        self._decryptor = None
        self._holding = True
        self.transport.pause_reading()
        done, self._body_done = self._body_done, None
        if done is None:  # a staged control body: the frame is delivered with it
            self._frames.put_nowait(Frame(header, self._targets[0] if self._targets else memoryview(b"")))
        elif not done.done():
            trailing = header.flags & FLAG_TRAILING_CHECKSUM
            done.set_result((self._crc, TRAILER.unpack(self._trailer)[0] if trailing else header.body_checksum))

    def _parse(self) -> None:
        """Turn every complete header in the read area into a frame, until a body must be read
        or held."""
        while not self._holding and self._body_header is None and not self.closed.is_set():
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
            if self._body_header is not None:  # a staged body: its first bytes may sit behind the header
                self._take_from_area()

    def _take_from_area(self) -> None:
        """Move body bytes already in the read area into the targets, as if they had just landed."""
        if self._recv_cipher is not None:
            self._area_start += self._open_body(self._area_view[self._area_start : self._area_end])
            return
        while self._body_header is not None and self._area_start < self._area_end:
            target = self._targets[self._target_index]
            take = min(self._area_end - self._area_start, len(target) - self._target_filled)
            target[self._target_filled : self._target_filled + take] = self._area_view[
                self._area_start : self._area_start + take
            ]
            self._area_start += take
            if self._landed(take):
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
        self._start_body(header, [self._staging_view(header.body_bytes)], None)

    def _staging_view(self, nbytes: int) -> memoryview:
        if len(self._staging) < nbytes:
            # A new buffer, not a resize: views of the old one may still be alive.
            self._staging = bytearray(min(self._max_frame_bytes, max(nbytes, 2 * len(self._staging))))
        return memoryview(self._staging)[:nbytes]

    def _start_body(self, header: FrameHeader, targets: list, algo: ChecksumAlgo | None) -> None:
        self._body_header = header
        self._targets = [t for t in targets if len(t)]
        self._body_targets = len(self._targets)
        self._expect_bytes = header.body_bytes
        if header.flags & FLAG_TRAILING_CHECKSUM:
            self._targets.append(memoryview(self._trailer))
            self._expect_bytes += TRAILER.size
        self._target_index = self._target_filled = self._filled_bytes = 0
        self._algo = None if algo == ChecksumAlgo.AEAD else algo
        self._crc = 0
        if self._recv_cipher is not None:  # the body's nonce follows its header's
            self._decryptor = self._recv_cipher.decryptor()
            self._cipher_left = header.body_bytes
            self._tag_filled = 0
        elif header.body_bytes == 0:
            self._body_complete()

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
        self._start_body(header, views, header.checksum_algo)
        self._take_from_area()
        if self._body_header is not None:  # more to come from the socket
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
        """Queue ``parts`` (raw bytes) on the transport and wait while its write buffer is over
        the high mark. Not on an encrypted link: use ``write_frame``."""
        assert self._send_cipher is None, "raw write on an encrypted link"
        await self._write_raw(parts)

    async def _write_raw(self, parts: Sequence[bytes | memoryview]) -> None:
        if self.transport is None:
            await self.made.wait()
        if self.closed.is_set() or self.transport.is_closing():
            raise ConnectionError(self.closed_reason or "connection is closing")
        self.transport.writelines(parts)
        await self._write_ready.wait()
        if self.closed.is_set():
            raise ConnectionError(self.closed_reason)

    async def write_frame(
        self, header: bytes, parts: Sequence[bytes | memoryview] = (), *, corrupt: bool = False, cut: bool = False
    ) -> None:
        """Write one frame: its packed ``header`` and body ``parts``; sealed on an encrypted
        link, the body encrypted a piece at a time, each piece written while it is in cache.
        Test-only faults there: ``corrupt`` flips one ciphertext byte (its tag then fails),
        ``cut`` stops after half the body (no tag). One frame at a time (the sender's writer)."""
        cipher = self._send_cipher
        if cipher is None:
            await self._write_raw((header, *parts))
            return
        assert not self._frame_writing, "two frames written at once on an encrypted link"
        self._frame_writing = True
        try:
            await self._write_raw((cipher.seal(header),))
            body_bytes = sum(len(p) for p in parts)
            if body_bytes:
                await self._write_sealed_body(cipher, parts, body_bytes, corrupt, cut)
        finally:
            self._frame_writing = False

    async def write_checked_frame(self, header: FrameHeader, parts: Sequence, corrupt: bool = False) -> None:
        """Write one plaintext data frame whose checksum trails its body: each piece (at most
        ``RECV_PIECE_BYTES``) is checksummed just before it is written, so the kernel's copy
        reads it from cache, and the checksum follows the body (``FLAG_TRAILING_CHECKSUM``).
        ``corrupt`` (test-only) damages a copy of one piece after checksumming it."""
        assert self._send_cipher is None, "checksummed frames are plaintext"
        algo = header.checksum_algo
        await self._write_raw((header._replace(flags=header.flags | FLAG_TRAILING_CHECKSUM, body_checksum=0).pack(),))
        crc, transport, ready = 0, self.transport, self._write_ready
        for part in parts:
            view = memoryview(part).cast("B")
            for offset in range(0, len(view), RECV_PIECE_BYTES):
                piece = view[offset : offset + RECV_PIECE_BYTES]
                crc = checksum(algo, piece, crc, hold_gil=len(piece) <= SMALL_PIECE_BYTES)
                if corrupt:
                    piece, corrupt = bytearray(piece), False
                    piece[len(piece) // 2] ^= 0xFF
                # _write_raw inlined: a coroutine per piece would cost more than the checks
                if self.closed.is_set() or transport.is_closing():
                    raise ConnectionError(self.closed_reason or "connection is closing")
                transport.write(piece)
                if not ready.is_set():
                    await ready.wait()
        await self._write_raw((TRAILER.pack(crc),))

    async def _write_sealed_body(
        self, cipher: Direction, parts: Sequence, body_bytes: int, corrupt: bool, cut: bool
    ) -> None:
        encryptor, written = cipher.encryptor(), 0
        for part in parts:
            view = memoryview(part).cast("B")
            for offset in range(0, len(view), RECV_PIECE_BYTES):
                piece = encryptor.update(view[offset : offset + RECV_PIECE_BYTES])
                if corrupt and written == 0:
                    piece = bytearray(piece)
                    piece[len(piece) // 2] ^= 0xFF
                written += len(piece)
                await self._write_raw((piece,))
                if cut and written >= body_bytes // 2:
                    return
        encryptor.finalize()
        await self._write_raw((encryptor.tag,))

    def write_frame_nowait(self, header: bytes, payload: bytes = b"") -> None:
        """Write one small frame (a reply) at once, without waiting on flow control; sealed on
        an encrypted link. Dropped once the connection is closing."""
        if self.transport is None or self.closed.is_set() or self.transport.is_closing():
            return
        cipher = self._send_cipher
        if cipher is None:
            self.transport.writelines((header, payload))
            return
        assert not self._frame_writing, "a reply written inside a frame on an encrypted link"
        # A small body sealed in one go has the streaming layout: ciphertext, then its tag.
        self.transport.writelines((cipher.seal(header), cipher.seal(payload)) if payload else (cipher.seal(header),))

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
