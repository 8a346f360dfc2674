"""``connection.FrameConnection`` at tiny sizes, fed bytes as the event loop feeds them
(``get_buffer`` / ``buffer_updated``, in arbitrary pieces): a deferred data body lands straight
in its targets (across target and piece boundaries, nothing staged) with its trailing
checksum checked; a sealed stream decrypts into the targets and a flipped ciphertext byte
fails the connection; an AEAD-checked frame on a plaintext link is a protocol error.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore.transfer.aead import CONNECTOR_TO_LISTENER, Direction
from kvstore.transfer.base import Frame, LinkClosed
from kvstore.transfer.connection import FrameConnection
from kvstore.transfer.frames import (
    FLAG_INLINE_BODY,
    FLAG_TRAILING_CHECKSUM,
    TRAILER,
    ChecksumAlgo,
    DType,
    FrameHeader,
    Kind,
    checksum,
)

KEY = bytes(range(32))
BODY = np.random.default_rng(3).integers(0, 256, size=3000, dtype=np.uint8).tobytes()


class FakeTransport:
    """What ``FrameConnection`` calls on a transport while reading."""

    def __init__(self) -> None:
        self.paused = self.aborted = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


def header(algo: ChecksumAlgo = ChecksumAlgo.CRC32, flags: int = FLAG_INLINE_BODY, crc: int = 0) -> FrameHeader:
    return FrameHeader(Kind.BLOB, "r", seq=1, dtype=DType.UINT8, shape=(len(BODY),), body_bytes=len(BODY),
                       body_checksum=crc, checksum_algo=algo, flags=flags)


def feed(conn: FrameConnection, transport: FakeTransport, data: bytes, piece_bytes: int) -> int:
    """Hand ``data`` to the connection while it reads; returns how many bytes it took."""
    position = 0
    while position < len(data) and not transport.paused and not transport.aborted:
        view = memoryview(conn.get_buffer(-1)).cast("B")  # what the kernel writes into
        n = min(len(view), len(data) - position, piece_bytes)
        view[:n] = data[position : position + n]
        conn.buffer_updated(n)
        position += n
    return position


async def receive(stream: bytes, piece_bytes: int, cipher: Direction | None = None):
    """Feed ``stream``; receive the first frame's body into two targets. Returns the targets,
    receive_into's result (or the exception it raised) and the connection."""
    conn, transport = FrameConnection(1 << 20, defer_data_bodies=True), FakeTransport()
    conn.connection_made(transport)
    if cipher is not None:
        conn.set_receive_cipher(cipher)
    taken = feed(conn, transport, stream, piece_bytes)
    frame = await conn.next_frame()
    assert isinstance(frame, Frame) and frame.inline is None  # delivered before its body
    targets = [np.zeros(1000, np.uint8), np.zeros(len(BODY) - 1000, np.uint8)]
    task = asyncio.ensure_future(conn.receive_into(frame.header, targets))
    await asyncio.sleep(0)
    feed(conn, transport, stream[taken:], piece_bytes)
    try:
        result = await task
    except ConnectionError as exc:
        result = exc
    return targets, result, conn


@pytest.mark.parametrize("piece_bytes", [1, 7, 160, 999, 1 << 16])
def test_deferred_body_lands_in_its_targets_with_its_trailing_checksum(piece_bytes):
    stream = header(flags=FLAG_INLINE_BODY | FLAG_TRAILING_CHECKSUM).pack() + BODY
    stream += TRAILER.pack(checksum(ChecksumAlgo.CRC32, BODY))
    targets, (staged, actual, expected), conn = asyncio.run(receive(stream, piece_bytes))
    assert b"".join(t.tobytes() for t in targets) == BODY
    assert staged.nbytes == 0 and len(conn._staging) == 0, "the body went through a staging buffer"
    assert actual == expected == checksum(ChecksumAlgo.CRC32, BODY)


def test_a_damaged_body_shows_as_a_checksum_that_differs():
    damaged = bytearray(BODY)
    damaged[1500] ^= 1
    stream = header(crc=checksum(ChecksumAlgo.CRC32, BODY)).pack() + bytes(damaged)
    _, (_, actual, expected), _ = asyncio.run(receive(stream, 512))
    assert expected == checksum(ChecksumAlgo.CRC32, BODY) and actual != expected


def sealed_stream(flip_at: int | None = None) -> bytes:
    out = Direction(KEY, CONNECTOR_TO_LISTENER)
    sealed_header = out.seal(header(ChecksumAlgo.AEAD).pack())  # nonces in order: the header's first
    body = bytearray(out.seal(BODY))  # one message, as a streamed body: ciphertext then tag
    if flip_at is not None:
        body[flip_at] ^= 1
    return sealed_header + bytes(body)


@pytest.mark.parametrize("piece_bytes", [5, 176, 4096])
def test_sealed_body_decrypts_into_its_targets(piece_bytes):
    targets, (_, actual, expected), _ = asyncio.run(
        receive(sealed_stream(), piece_bytes, Direction(KEY, CONNECTOR_TO_LISTENER))
    )
    assert b"".join(t.tobytes() for t in targets) == BODY and actual == expected == 0


@pytest.mark.parametrize("flip_at", [10, len(BODY) + 3], ids=["ciphertext", "tag"])
def test_a_flipped_ciphertext_byte_fails_the_connection(flip_at):
    _, result, conn = asyncio.run(receive(sealed_stream(flip_at), 256, Direction(KEY, CONNECTOR_TO_LISTENER)))
    assert isinstance(result, ConnectionError) and "failed authentication" in str(result)
    assert conn.closed.is_set()


def test_an_aead_frame_on_a_plaintext_link_is_refused():
    async def scenario() -> LinkClosed:
        conn, transport = FrameConnection(1 << 20, defer_data_bodies=True), FakeTransport()
        conn.connection_made(transport)
        feed(conn, transport, header(ChecksumAlgo.AEAD).pack() + BODY, 4096)
        return await conn.next_frame()

    closed = asyncio.run(scenario())
    assert isinstance(closed, LinkClosed) and "not encrypted" in closed.reason
