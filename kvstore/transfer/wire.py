"""The stream links every backend builds on: ``StreamSendLink`` / ``StreamRecvLink`` implement
the link protocols of ``base.py`` over a ``connection.FrameConnection`` (re-exported here)
with inline bodies, which is the TCP backend as is; shm and ucx override only the body path.
``seal`` checksums a body before it is sent, ``land`` hands on a body already in memory.

On the sender a body leaves from the caller's memoryviews (zero-copy), or, on an encrypted
link, sealed a piece at a time (``ChecksumAlgo.AEAD``: the tag replaces the checksum). On the
tcp receiver a data body goes straight into its destination (``read_data`` with targets).

Everything here runs on the I/O loop thread; nothing is locked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvstore.transfer.base import Frame, LinkClosed
from kvstore.transfer.connection import FrameConnection
from kvstore.transfer.direct import copy_with_checksum
from kvstore.transfer.frames import (
    FLAG_INLINE_BODY,
    ChecksumAlgo,
    FrameError,
    FrameHeader,
    Kind,
    checksum,
    control_header,
)

__all__ = ["FrameConnection", "StreamRecvLink", "StreamSendLink", "land", "seal", "with_inline"]

logger = logging.getLogger(__name__)


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


def land(header: FrameHeader, body, targets: list | None) -> tuple[memoryview, int, int]:
    """A body that is already in memory (a ring slot, a UCX buffer, a staged frame) handed on as
    ``RecvLink.read_data`` does: into ``targets`` with the checksum computed block by block
    while copying (``direct.copy_with_checksum``), or as it is with its checksum."""
    if targets is None:
        return memoryview(body), checksum(header.checksum_algo, body), header.body_checksum
    if not header.body_bytes:
        return memoryview(b""), checksum(header.checksum_algo, b""), header.body_checksum
    crc = copy_with_checksum(header.checksum_algo, [memoryview(body)], targets)
    return memoryview(b""), crc, header.body_checksum


class StreamSendLink:
    """Sender end of a stream link; bodies ride inline (the TCP backend as is)."""

    coalesces = True  # the sender may hand it one frame made of several chunks' bodies
    trailing_checksums = True  # data frames' checksums follow their bodies (the peer is a tcp receiver)

    def __init__(self, conn: FrameConnection):
        self.conn = conn

    async def send_data(
        self, header: FrameHeader, parts: Sequence[memoryview], corrupt: bool = False, more: bool = False
    ) -> None:
        """Checksum the body (``parts`` in order) and send it inline, zero-copy (``corrupt``:
        damage it after checksumming); on an encrypted link seal it instead (the tag is its
        check; ``corrupt`` damages the ciphertext)."""
        if self.conn.encrypted:
            header = header._replace(checksum_algo=ChecksumAlgo.AEAD, body_checksum=0)
            await self.conn.write_frame(with_inline(header).pack(), parts, corrupt=corrupt)
        elif header.body_bytes and self.trailing_checksums:
            await self.conn.write_checked_frame(with_inline(header), parts, corrupt)
        else:
            header, parts = seal(header, parts, corrupt)
            await self.conn.write_frame(with_inline(header).pack(), parts)

    async def flush(self) -> None:
        """Write out anything the link batches; the sender calls it whenever its queue is empty."""

    async def send_control(self, header: FrameHeader, payload: bytes) -> None:
        await self.conn.write_frame(header.pack(), (payload,))

    async def send_truncated(self, header: FrameHeader, body: memoryview) -> None:
        """Fault injection: half the body, then end the stream (FIN, not RST: the bytes arrive)."""
        if self.conn.encrypted:
            header = header._replace(checksum_algo=ChecksumAlgo.AEAD, body_checksum=0)
            await self.conn.write_frame(with_inline(header).pack(), (body,), cut=True)
        else:
            await self.conn.write_frame(with_inline(header).pack(), (body[: len(body) // 2],))
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

    def lands_apart(self, frame: Frame) -> bool:
        return False  # bodies ride the stream, right behind their headers

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

    async def read_data(self, frame: Frame, targets: list | None) -> tuple[memoryview, int, int]:
        """The body of a data frame, received into ``targets`` (writable uint8 arrays in body
        order, adding up to its ``body_bytes``) or, when None, into a buffer of the link's
        (valid until ``release``). Returns that buffer (empty for targets), the body's
        checksum under its header's algorithm, computed as it landed, and the checksum the
        sender gave. ConnectionError if the stream ends first."""
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
        self.conn.write_frame_nowait(header.pack(), payload)

    def close(self) -> None:
        self.conn.close()
