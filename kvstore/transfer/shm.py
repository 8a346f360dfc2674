"""Shared-memory backend (same host): headers over a unix socket, bodies through a ring in
shared memory, one copy each way.

Per sender connection the sender creates a ring file in /dev/shm (``config.shm_ring_bytes``),
announces it in a HELLO frame, and the receiver maps it and unlinks the name at once, so a
killed process leaks nothing once the handshake is done. The sender copies each body into a
ring slot (``aux`` = offset) and sends the header; the receiver verifies the checksum on the
ring bytes, its sink copies them into the destination, and its ACK frees the slot. Slots are
freed in sequence order, so the ring is a FIFO::

    0                tail (oldest unacked)        head (next free)                 size
    |  free (wraps)  |###### in flight ###########|     free                       |

The listener binds an abstract unix socket ``\\0tidekv-NAME`` (address ``shm://NAME``): no
file to clean up, local to the host's network namespace. Runs on the I/O loop only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import mmap
import os
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import replace

import numpy as np

from kvstore.transfer.base import Address, Frame, LinkClosed, RecvLink, TransferConfig, TransferError
from kvstore.transfer.frames import HEADER_BYTES, FrameError, FrameHeader, Kind, control_header
from kvstore.transfer.tcp import StreamListener, serve_factory
from kvstore.transfer.wire import FrameConnection, StreamRecvLink, StreamSendLink

SHM_DIR = "/dev/shm"
_HELLO = struct.Struct("<Q")  # ring size; followed by the ring file name


def _socket_path(name: str) -> str:
    return "\0tidekv-" + name


class ShmRing:
    """The sender's ring: allocation in FIFO order, freed by ACKs. I/O loop only."""

    def __init__(self, size_bytes: int):
        self.name = f"tidekv-ring-{os.getpid()}-{secrets.token_hex(6)}"
        self.size_bytes = size_bytes
        fd = os.open(os.path.join(SHM_DIR, self.name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size_bytes)
            self._map = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self._slots: collections.deque[tuple[int, int, int]] = collections.deque()  # (seq, offset, nbytes)
        self._head = 0
        self._freed = asyncio.Event()
        self._closed_reason: str | None = None

    def unlink(self) -> None:
        # Usually the receiver has already unlinked it after mapping, as intended.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))

    def _try_place(self, nbytes: int) -> int | None:
        if not self._slots:
            self._head = 0
            return 0 if nbytes <= self.size_bytes else None
        tail = self._slots[0][1]
        if self._head >= tail:  # free space is [head, size) and [0, tail)
            if self._head + nbytes <= self.size_bytes:
                return self._head
            return 0 if nbytes < tail else None
        return self._head if self._head + nbytes < tail else None

    async def alloc(self, seq: int, nbytes: int) -> int:
        """Offset of a free slot of ``nbytes``; waits for ACKs while the ring is full."""
        while (offset := self._try_place(nbytes)) is None:
            if self._closed_reason is not None:
                raise ConnectionError(self._closed_reason)
            self._freed.clear()
            await self._freed.wait()
        self._slots.append((seq, offset, nbytes))
        self._head = offset + nbytes
        return offset

    def release(self, seq: int) -> None:
        """Free every slot up to frame ``seq`` (ACKs are cumulative)."""
        while self._slots and self._slots[0][0] <= seq:
            self._slots.popleft()
            self._freed.set()

    def fail(self, reason: str) -> None:
        self._closed_reason = reason
        self._freed.set()


class ShmSendLink(StreamSendLink):
    """Sender end: header on the socket, body through the ring."""

    def __init__(self, conn: FrameConnection, ring: ShmRing):
        super().__init__(conn)
        self.ring = ring

    async def send_data(self, header: FrameHeader, body: memoryview) -> None:
        offset = await self.ring.alloc(header.seq, body.nbytes)
        np.copyto(self.ring.array[offset : offset + body.nbytes], np.frombuffer(body, dtype=np.uint8))
        await self.conn.write(_with_offset(header, offset).pack())

    async def send_truncated(self, header: FrameHeader, body: memoryview) -> None:
        """Fault injection: half a header, then end the stream."""
        await self.conn.write(header.pack()[: HEADER_BYTES // 2])
        self.conn.write_eof()

    def on_ack(self, seq: int) -> None:
        self.ring.release(seq)

    def close(self) -> None:
        self.ring.fail("connection closed")
        self.ring.unlink()
        super().close()


def _with_offset(header: FrameHeader, offset: int) -> FrameHeader:
    return replace(header, aux=offset)


class ShmRecvLink(StreamRecvLink):
    """Receiver end: bodies are views of the sender's ring."""

    def __init__(self, conn: FrameConnection, ring_map: mmap.mmap):
        super().__init__(conn)
        self._ring = memoryview(ring_map)

    async def read_body(self, frame: Frame) -> memoryview:
        header = frame.header
        if frame.inline is not None or not header.kind.is_data:
            return await super().read_body(frame)
        end = header.aux + header.body_bytes
        if end > len(self._ring):
            raise FrameError(f"{header.describe()}: ring slot [{header.aux}, {end}) beyond ring of {len(self._ring)}")
        return self._ring[header.aux : end]


async def _accept(conn: FrameConnection, config: TransferConfig) -> RecvLink:
    """Receiver side of the handshake: map the sender's ring, unlink its name, say HELLO."""
    async with asyncio.timeout(config.connect_timeout_s):
        item = await conn.next_frame()
    if isinstance(item, LinkClosed) or item.header.kind != Kind.HELLO or item.inline is None:
        raise FrameError(f"shm handshake: expected HELLO, got {item}")
    payload = bytes(item.inline)
    conn.release()
    (size_bytes,) = _HELLO.unpack_from(payload)
    name = payload[_HELLO.size :].decode()
    if "/" in name or not name.startswith("tidekv-ring-"):
        raise FrameError(f"shm handshake: bad ring name {name!r}")
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size_bytes:
            raise FrameError(f"shm ring {name} is {os.fstat(fd).st_size} bytes, HELLO says {size_bytes}")
        ring_map = mmap.mmap(fd, size_bytes)
    finally:
        os.close(fd)
        os.unlink(path)
    conn.transport.write(control_header(Kind.HELLO, "").pack())
    return ShmRecvLink(conn, ring_map)


class ShmBackend:
    scheme = "shm"

    async def listen(self, config: TransferConfig, on_link: Callable[[RecvLink], Awaitable[None]]) -> StreamListener:
        tasks: set[asyncio.Task] = set()
        name = f"{os.getpid()}-{secrets.token_hex(6)}"

        async def make_link(conn: FrameConnection) -> RecvLink:
            return await _accept(conn, config)

        factory = serve_factory(config, make_link, on_link, tasks)
        server = await asyncio.get_running_loop().create_unix_server(factory, path=_socket_path(name))
        return StreamListener(str(Address("shm", name=name)), server, tasks)

    async def connect(self, address: Address, config: TransferConfig) -> ShmSendLink:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(config.connect_timeout_s):
                # uvloop cannot connect to an abstract path itself; a connected socket it can adopt.
                await loop.sock_connect(sock, _socket_path(address.name))
                _, conn = await loop.create_unix_connection(lambda: FrameConnection(config.max_frame_bytes), sock=sock)
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise TransferError(f"cannot connect to {address}: {exc!r}") from exc
        ring = ShmRing(config.shm_ring_bytes)
        try:
            await _handshake(conn, ring, config)
        except BaseException:
            ring.unlink()
            conn.close()
            raise
        return ShmSendLink(conn, ring)


async def _handshake(conn: FrameConnection, ring: ShmRing, config: TransferConfig) -> None:
    payload = _HELLO.pack(ring.size_bytes) + ring.name.encode()
    await conn.write(control_header(Kind.HELLO, "", payload=payload).pack(), payload)
    try:
        async with asyncio.timeout(config.connect_timeout_s):
            reply = await conn.next_frame()
    except TimeoutError as exc:
        raise TransferError("shm handshake: no HELLO from the receiver in time") from exc
    if isinstance(reply, LinkClosed) or reply.header.kind != Kind.HELLO:
        raise TransferError(f"shm handshake failed: {reply}")
