"""Shared-memory backend (same host): headers over a unix socket; each body copied once, either
straight into the receiver's destination (direct placement) or through a ring.

Direct placement, when the receiver's sink lives in shareable memory (``base.DirectSink``): the
first time a request appears on a connection the sender asks for its placement (OPEN), the
receiver answers with the byte ranges of its pages and state tensors (PLACE, ``placement``),
and from then on the sender copies each body into those ranges, checksumming every block as
it copies it (``direct``), and sends a FLAG_DIRECT header. A row chunk of more than
``direct.DIRECT_PIECE_BYTES`` with no other data frame queued behind it goes a piece of rows
at a time, each piece's header written as soon as it is in place, so the receiver's check
overlaps the rest of the copy. The receiver checksums the bytes in place before it counts the
chunk; a failure fails the request, whose memory is not reused until the sender has confirmed
(REVOKED, in answer to the ERROR) that it writes no more.
Headers of small frames are batched into one write per ``FLUSH_BYTES`` of bodies.

The ring (no placement: private destination memory, a blob, another user's peer): per
connection the sender creates a ring file in /dev/shm (``config.shm_ring_bytes``), announces
it in HELLO, and the receiver maps it and unlinks the name at once, so a killed process leaks
nothing once the handshake is done. The sender copies each body into a ring slot (``aux`` =
offset); the receiver verifies it there and its sink copies it out (two copies); its ACK frees
the slot (``ring.ShmRing``).

The listener binds an abstract unix socket ``\\0tidekv-NAME`` (address ``shm://NAME``): no
file to clean up, local to the host's network namespace. Like every stream connection it
starts with the authentication exchange of ``auth`` (before the ring HELLO); then it admits
only peers running as its own user (``SO_PEERCRED``), who could read and write its memory
through /proc anyway. Runs on the I/O loop only.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from kvstore.transfer import direct
from kvstore.transfer.auth import connection_factory, prove_to
from kvstore.transfer.base import Address, Frame, LinkClosed, RecvLink, TransferConfig, TransferError
from kvstore.transfer.direct import PeerRegions, copy_with_checksum
from kvstore.transfer.frames import FLAG_DIRECT, HEADER_BYTES, FrameError, FrameHeader, Kind, control_header
from kvstore.transfer.placement import PagePlacement
from kvstore.transfer.ring import SHM_DIR, ShmRing
from kvstore.transfer.tcp import StreamListener, serve_factory
from kvstore.transfer.wire import FrameConnection, StreamRecvLink, StreamSendLink, land, seal

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("<Q")  # ring size; followed by the ring file name
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
FLUSH_BYTES = 1 << 20  # batch headers until this many body bytes (or FLUSH_FRAMES frames) wait
FLUSH_FRAMES = 64
MAX_PLACEMENTS = 4096
_UNASKED = object()
_REVOKED = object()


def _socket_path(name: str) -> str:
    return "\0tidekv-" + name


class ShmSendLink(StreamSendLink):
    """Sender end: header on the socket, body into the receiver's placement or the ring."""

    def __init__(self, conn: FrameConnection, ring: ShmRing, peer_pid: int, open_timeout_s: float):
        super().__init__(conn)
        self.ring = ring
        self._regions = PeerRegions(peer_pid)
        self._open_timeout_s = open_timeout_s
        # request id -> its placement, None (none given: use the ring), _REVOKED (the receiver
        # failed it: use the ring), or the future of an OPEN still unanswered. Entries go at
        # END/ABORT; MAX_PLACEMENTS bounds those of requests that failed before their END.
        self._placements: dict[str, object] = {}
        self._batch: list[bytes] = []
        self._batch_bytes = 0

    async def send_data(
        self, header: FrameHeader, parts: Sequence[memoryview], corrupt: bool = False, more: bool = False
    ) -> None:
        placement = await self._placement(header.request_id)
        if placement is None or not self._try_direct(header, parts, corrupt, placement, more):
            await self._send_via_ring(header, parts, corrupt)
        if self._batch_bytes >= FLUSH_BYTES or len(self._batch) >= FLUSH_FRAMES:
            await self.flush()

    def _try_direct(
        self, header: FrameHeader, parts: Sequence[memoryview], corrupt: bool, placement: PagePlacement, more: bool
    ) -> bool:
        """Copy the body into its placement and queue its header; False if it has no place there.

        With no other data frame queued behind it (``more`` False), a large row chunk is copied a
        piece of rows at a time (``direct.pieces``), each piece's header written as soon as it
        is in place, so the receiver verifies piece k on its core while this one copies piece k + 1;
        the last piece's check is all that remains after the copy. (With a frame queued behind
        it, the receiver checks this one while the next is copied: pieces would only add
        wakeups.) Every piece is a chunk of its own to the receiver (own token range and
        checksum), and all carry the frame's seq."""
        segments = placement.segments(header.kind, header.layer, header.token_start, header.token_end)
        if segments is None or sum(n for _, _, n in segments) != header.body_bytes:
            return False
        # Checked on every frame: once our transport is closing nothing may be written any more.
        if self.conn.closed.is_set() or self.conn.transport.is_closing():
            raise ConnectionError(self.conn.closed_reason or "connection is closing")
        pieces = [header] if more else direct.pieces(header)
        if len(pieces) > 1 and self._batch:
            self._write_batch()  # the headers of earlier frames go first
        for index, piece in enumerate(pieces):
            try:
                at = segments if piece is header else direct.byte_range(segments, piece.aux, piece.body_bytes)
                targets = self._regions.targets(placement.regions, at)
            except FrameError as exc:  # the receiver's memory cannot be mapped here
                if index:  # pieces already announced: the receiver fails the rest as missing
                    raise ConnectionError(f"direct write failed midway: {exc}") from exc
                logger.warning("request %r: direct write impossible (%s); using the ring", header.request_id, exc)
                self._placements[header.request_id] = None
                return False
            body = parts if piece is header else direct.byte_range(parts, piece.aux, piece.body_bytes)
            crc = copy_with_checksum(header.checksum_algo, body, targets)
            if corrupt and index == len(pieces) // 2:  # fault injection: damage it after checksumming
                _flip_middle_byte(targets, piece.body_bytes)
            self._batch.append(piece._replace(aux=0, body_checksum=crc, flags=header.flags | FLAG_DIRECT).pack())
            self._batch_bytes += piece.body_bytes
            if len(pieces) > 1:
                self._write_batch()
        return True

    def _write_batch(self) -> None:
        """Write the queued headers now, without waiting for the transport to drain (a few
        hundred bytes; ``flush`` waits)."""
        parts, self._batch, self._batch_bytes = self._batch, [], 0
        self.conn.transport.writelines(parts)

    async def _send_via_ring(self, header: FrameHeader, parts: Sequence[memoryview], corrupt: bool) -> None:
        header, parts = seal(header, parts, corrupt)
        offset = self.ring.try_alloc(header.seq, header.body_bytes)
        if offset is None:
            await self.flush()  # the receiver frees ring slots only for headers it has seen
            offset = await self.ring.alloc(header.seq, header.body_bytes)
        position = offset
        for part in parts:
            np.copyto(self.ring.array[position : position + part.nbytes], np.frombuffer(part, dtype=np.uint8))
            position += part.nbytes
        self._batch.append(header._replace(aux=offset).pack())
        self._batch_bytes += header.body_bytes

    async def flush(self) -> None:
        if self._batch:
            parts, self._batch, self._batch_bytes = self._batch, [], 0
            await self.conn.write(*parts)
        await asyncio.sleep(0)  # let the reply reader run (an ERROR revokes a placement)

    async def _placement(self, request_id: str) -> PagePlacement | None:
        """The request's placement, asking the receiver (OPEN) the first time."""
        state = self._placements.get(request_id, _UNASKED)
        if state is _UNASKED:
            await self.flush()
            state = asyncio.get_running_loop().create_future()
            self._remember(request_id, state)
            await self.conn.write(control_header(Kind.OPEN, request_id).pack())
        if isinstance(state, asyncio.Future):
            try:
                async with asyncio.timeout(self._open_timeout_s):
                    await asyncio.shield(state)
            except TimeoutError:
                logger.warning("no PLACE for %r within %.3g s; using the ring", request_id, self._open_timeout_s)
                self._placements[request_id] = None
            state = self._placements.get(request_id)
        return state if isinstance(state, PagePlacement) else None

    def _remember(self, request_id: str, state: object) -> None:
        self._placements[request_id] = state
        if len(self._placements) > MAX_PLACEMENTS:  # requests that failed before their END
            stale = [rid for rid, v in self._placements.items() if not isinstance(v, asyncio.Future)]
            for rid in stale[: len(stale) // 2]:
                del self._placements[rid]

    async def send_control(self, header: FrameHeader, payload: bytes) -> None:
        if header.kind in (Kind.END, Kind.ABORT):
            self._placements.pop(header.request_id, None)  # nothing is written after END/ABORT
        await self.flush()
        await super().send_control(header, payload)

    async def next_reply(self) -> Frame | LinkClosed:
        """Next reply for the sender; PLACE answers are consumed here, ERRORs revoke first."""
        while True:
            item = await super().next_reply()
            if isinstance(item, LinkClosed):
                self._answer_all_opens()
                return item
            if item.header.kind == Kind.PLACE:
                self._on_place(item.header.request_id, bytes(item.inline or b""))
                continue
            if item.header.kind == Kind.ERROR:
                self._revoke(item.header.request_id)
            return item

    def _on_place(self, request_id: str, payload: bytes) -> None:
        state = self._placements.get(request_id)
        if not isinstance(state, asyncio.Future):
            return  # an answer we stopped waiting for; our END fences the receiver
        placement = None
        if payload:
            try:
                placement = PagePlacement.unpack(payload)
            except FrameError as exc:
                logger.warning("request %r: unusable placement (%s); using the ring", request_id, exc)
        self._placements[request_id] = placement
        state.set_result(None)

    def _revoke(self, request_id: str) -> None:
        """The receiver failed the request: stop writing into its placement and say so, after
        the headers of frames already written (this runs between two copies: one loop thread).
        Answered once per request whatever we held, so the receiver never waits out its fence."""
        state = self._placements.get(request_id)
        if state is _REVOKED:
            return
        if isinstance(state, asyncio.Future) and not state.done():
            state.set_result(None)
        self._remember(request_id, _REVOKED)
        parts, self._batch, self._batch_bytes = self._batch, [], 0
        parts.append(control_header(Kind.REVOKED, request_id).pack())
        if not self.conn.closed.is_set() and not self.conn.transport.is_closing():
            self.conn.transport.writelines(parts)

    def _answer_all_opens(self) -> None:
        for rid, state in list(self._placements.items()):
            if isinstance(state, asyncio.Future) and not state.done():
                self._placements[rid] = None
                state.set_result(None)

    async def send_truncated(self, header: FrameHeader, body: memoryview) -> None:
        """Fault injection: half a header, then end the stream."""
        await self.flush()
        await self.conn.write(header.pack()[: HEADER_BYTES // 2])
        self.conn.write_eof()

    def on_ack(self, seq: int) -> None:
        self.ring.release(seq)

    def close(self) -> None:
        self.ring.fail("connection closed")
        self.ring.unlink()
        super().close()  # the transport is closing from here on: no direct write starts again
        self._regions.close()


def _flip_middle_byte(targets: list[np.ndarray], nbytes: int) -> None:
    position = nbytes // 2
    for target in targets:
        if position < len(target):
            target[position] ^= 0xFF
            return
        position -= len(target)


class ShmRecvLink(StreamRecvLink):
    """Receiver end: bodies are views of the sender's ring, or already in the destination."""

    supports_placement = True

    def __init__(self, conn: FrameConnection, ring_map: mmap.mmap):
        super().__init__(conn)
        self._ring = memoryview(ring_map)

    async def read_data(self, frame: Frame, targets: list | None) -> tuple[memoryview, int, int]:
        """A ring slot's body: checksummed while it is copied into ``targets`` (or as it is)."""
        header = frame.header
        if frame.inline is not None or header.flags & FLAG_DIRECT:
            return await super().read_data(frame, targets)
        end = header.aux + header.body_bytes
        if end > len(self._ring):
            raise FrameError(f"{header.describe()}: ring slot [{header.aux}, {end}) beyond ring of {len(self._ring)}")
        return land(header, self._ring[header.aux : end], targets)


def _peer_credentials(sock) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket, from the kernel."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))


async def _accept(conn: FrameConnection, config: TransferConfig) -> RecvLink:
    """Receiver side of the handshake: check the peer's user, map the sender's ring, unlink
    its name, say HELLO."""
    uid = _peer_credentials(conn.transport.get_extra_info("socket"))[1]
    if uid != os.getuid():
        raise FrameError(f"shm peer runs as uid {uid}, this receiver as {os.getuid()}: refused")
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

        factory = serve_factory(config, self.scheme, make_link, on_link, tasks)
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
                peer_pid = _peer_credentials(sock)[0]
                _, conn = await loop.create_unix_connection(connection_factory(config), sock=sock)
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise TransferError(f"cannot connect to {address}: {exc!r}") from exc
        try:
            await prove_to(conn, config, str(address))
        except BaseException:
            conn.close()
            raise
        ring = ShmRing(config.shm_ring_bytes)
        try:
            await _handshake(conn, ring, config)
        except BaseException:
            ring.unlink()
            conn.close()
            raise
        return ShmSendLink(conn, ring, peer_pid, config.connect_timeout_s)


async def _handshake(conn: FrameConnection, ring: ShmRing, config: TransferConfig) -> None:
    payload = _HELLO.pack(ring.size_bytes) + ring.name.encode()
    try:
        await conn.write(control_header(Kind.HELLO, "", payload=payload).pack(), payload)
    except ConnectionError as exc:  # the receiver refused us (another user) or went away
        raise TransferError(f"shm handshake failed: {exc}") from exc
    try:
        async with asyncio.timeout(config.connect_timeout_s):
            reply = await conn.next_frame()
    except TimeoutError as exc:
        raise TransferError("shm handshake: no HELLO from the receiver in time") from exc
    if isinstance(reply, LinkClosed) or reply.header.kind != Kind.HELLO:
        raise TransferError(f"shm handshake failed: {reply}")
