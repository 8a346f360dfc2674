"""``FrameWriter``: the send side of one ``connection.FrameConnection``: frames written to its
transport, whole or a piece at a time, and the wait on the transport's flow control.

Writes go out with ``writelines`` from the caller's memoryviews (zero-copy when plaintext) and
then wait while the transport's write buffer is over its high mark: the connection's
``pause_writing`` / ``resume_writing`` clear and set the event passed in here, and its close
sets it (the wait then raises ``ConnectionError``). A plaintext data frame may carry its
checksum after its body (``write_checked_frame``): each piece is checksummed just before it is
written, while it is in cache. Encrypted (``set_cipher``, switched on by the handshake of
``auth`` on tcp links with ``TransferConfig.encrypt``; layout in ``aead``): writes are whole
frames (``write_frame``), sealed, a body encrypted piece by piece just before each piece is
written. Everything here runs on the I/O loop thread; nothing is locked.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from typing import Protocol

from kvstore.transfer.aead import Direction
from kvstore.transfer.body import RECV_PIECE_BYTES, SMALL_PIECE_BYTES
from kvstore.transfer.frames import FLAG_TRAILING_CHECKSUM, TRAILER, FrameHeader, checksum


class WrittenStream(Protocol):
    """What a writer reads of its connection (``FrameConnection``), which sets all of it."""

    made: asyncio.Event  # set once the transport is made (``connected``)
    closed: asyncio.Event
    closed_reason: str  # why it closed, once ``closed`` is set


class FrameWriter:
    """The frames one connection writes (see the module docstring). One frame at a time on an
    encrypted link (the sender's writer); replies (``write_frame_nowait``) go between frames."""

    def __init__(self, conn: WrittenStream, ready: asyncio.Event):
        # The connection owns its writer: a strong reference back would make a cycle, and a closed
        # connection's buffers would then wait for the cycle collector. Its events never change.
        self._conn = weakref.proxy(conn)
        self._made = conn.made
        self._closed = conn.closed
        self._ready = ready  # set while the transport accepts more (flow control), and once closed
        self.transport: asyncio.Transport | None = None  # the connection's, once made (``connected``)
        self.cipher: Direction | None = None  # the send direction's key once encrypted
        self._frame_writing = False  # an encrypted frame is being written piece by piece
        self._eof_sent = False

    def connected(self, transport: asyncio.BaseTransport) -> None:
        """The connection's transport is made: writes go to it from now on."""
        self.transport = transport

    def set_cipher(self, direction: Direction) -> None:
        """Everything written from now on is sealed under ``direction``'s key (``write_frame``)."""
        self.cipher = direction

    async def write(self, *parts: bytes | memoryview) -> None:
        """Queue ``parts`` (raw bytes) on the transport and wait while its write buffer is over
        the high mark. Not on an encrypted link: use ``write_frame``."""
        assert self.cipher is None, "raw write on an encrypted link"
        await self._write_raw(parts)

    async def _write_raw(self, parts: Sequence[bytes | memoryview]) -> None:
        if self.transport is None:
            await self._made.wait()
        if self._closed.is_set() or self.transport.is_closing():
            raise ConnectionError(self._conn.closed_reason or "connection is closing")
        self.transport.writelines(parts)
        await self._ready.wait()
        if self._closed.is_set():
            raise ConnectionError(self._conn.closed_reason)

    async def write_frame(
        self, header: bytes, parts: Sequence[bytes | memoryview] = (), *, corrupt: bool = False, cut: bool = False
    ) -> None:
        """Write one frame: its packed ``header`` and body ``parts``; sealed on an encrypted
        link, the body encrypted a piece at a time, each piece written while it is in cache.
        Test-only faults there: ``corrupt`` flips one ciphertext byte (its tag then fails),
        ``cut`` stops after half the body (no tag). One frame at a time (the sender's writer)."""
        cipher = self.cipher
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
        assert self.cipher is None, "checksummed frames are plaintext"
        algo = header.checksum_algo
        await self._write_raw((header._replace(flags=header.flags | FLAG_TRAILING_CHECKSUM, body_checksum=0).pack(),))
        crc, transport, ready = 0, self.transport, self._ready
        for part in parts:
            view = memoryview(part).cast("B")
            for offset in range(0, len(view), RECV_PIECE_BYTES):
                piece = view[offset : offset + RECV_PIECE_BYTES]
                crc = checksum(algo, piece, crc, hold_gil=len(piece) <= SMALL_PIECE_BYTES)
                if corrupt:
                    piece, corrupt = bytearray(piece), False
                    piece[len(piece) // 2] ^= 0xFF
                # _write_raw inlined: a coroutine per piece would cost more than the checks
                if self._closed.is_set() or transport.is_closing():
                    raise ConnectionError(self._conn.closed_reason or "connection is closing")
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
        if self.transport is None or self._closed.is_set() or self.transport.is_closing():
            return
        cipher = self.cipher
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
