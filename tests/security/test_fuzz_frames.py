"""Fuzzing with hypothesis of the transfer frame parser (``frames.unpack_header``) and the
stream reader that drives it (``connection.FrameConnection``, through ``wire``).

Random and damaged bytes raise ``FrameError`` or close the connection with a protocol error,
and a declared body beyond ``max_frame_bytes`` is refused before its buffer is allocated.

Every run is derandomized (CI sees the same examples each time) and keeps no example database
(``fuzz_support.fuzz``).
"""

from __future__ import annotations

import math
import struct
import tracemalloc
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.transfer.base import Frame, LinkClosed
from kvstore.transfer.frames import (
    FLAG_INLINE_BODY,
    FRAME_VERSION,
    HEADER_BYTES,
    MAGIC,
    DType,
    FrameError,
    FrameHeader,
    Kind,
    checksum,
    control_header,
    unpack_header,
)
from kvstore.transfer.wire import FrameConnection
from tests.security.fuzz_support import fuzz

REAL_HEADERS = (
    FrameHeader(Kind.MLA_ROWS, "req-1", seq=3, layer=2, token_start=16, token_end=32, dtype=DType.BFLOAT16,
                shape=(16, 64), body_bytes=16 * 64 * 2, body_checksum=0x1234, flags=FLAG_INLINE_BODY),
    FrameHeader(Kind.KDA_STATE, "\u00e9t\u00e9", seq=9, layer=1, dtype=DType.FLOAT32, shape=(2, 4, 4),
                body_bytes=128, aux=4096),
    control_header(Kind.ABORT, "req-2", seq=5, payload=b"gave up"),
)
# The documented layout (frames' module docstring), written out again so that the test builds
# headers with any field values, checksummed, independently of FrameHeader.pack.
HEADER_LAYOUT = (("magic", "4s"), ("version", "H"), ("kind", "B"), ("dtype", "B"), ("ndim", "B"), ("algo", "B"),
                 ("rid_len", "B"), ("flags", "B"), ("layer", "i"), ("seq", "Q"), ("token_start", "q"),
                 ("token_end", "q"), ("s0", "q"), ("s1", "q"), ("s2", "q"), ("s3", "q"), ("body_bytes", "Q"),
                 ("aux", "Q"), ("body_checksum", "I"), ("rid", "64s"))
LAYOUT = struct.Struct("<" + "".join(code for _, code in HEADER_LAYOUT))
assert LAYOUT.size + 4 == HEADER_BYTES


def _flip(data: bytes, position: int, xor: int) -> bytes:
    out = bytearray(data)
    out[position % len(out)] ^= xor
    return bytes(out)


@fuzz(300)
@given(raw=st.one_of(st.binary(max_size=2 * HEADER_BYTES), st.binary(min_size=HEADER_BYTES, max_size=HEADER_BYTES),
                     st.binary(min_size=HEADER_BYTES - 6, max_size=HEADER_BYTES - 6).map(
                         lambda rest: MAGIC + struct.pack("<H", FRAME_VERSION) + rest)))
def test_random_bytes_raise_frame_error(raw):
    with pytest.raises(FrameError):
        unpack_header(raw)


@fuzz(300)
@given(base=st.sampled_from(REAL_HEADERS), flips=st.lists(st.tuples(st.integers(0, HEADER_BYTES - 1),
                                                                    st.integers(1, 255)), max_size=4))
def test_damaged_headers_raise_frame_error(base, flips):
    raw = base.pack()
    for position, xor in flips:
        raw = _flip(raw, position, xor)
    if raw == base.pack():  # no flips, or flips that cancel out
        assert unpack_header(raw) == base
    else:
        with pytest.raises(FrameError):
            unpack_header(raw)


def _any(code: str) -> st.SearchStrategy[int]:
    """Any value of the struct integer ``code``."""
    bits = struct.calcsize("<" + code) * 8
    return st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if code.islower() else st.integers(0, (1 << bits) - 1)


@st.composite
def checksummed_headers(draw) -> bytes:
    """Headers with a correct header checksum and in-range field values, except (in most
    examples) one field set to anything its width holds: what a buggy or hostile peer, rather
    than line noise, sends."""
    ndim = draw(st.integers(0, 4))
    shape = draw(st.lists(st.one_of(st.integers(0, 64), _any("q")), min_size=4, max_size=4))
    dtype = draw(st.sampled_from(list(DType)))
    rid = draw(st.text(max_size=20).map(str.encode).filter(lambda b: len(b) <= 64))
    fields = {"magic": MAGIC, "version": FRAME_VERSION, "kind": int(draw(st.sampled_from(list(Kind)))),
              "dtype": int(dtype), "ndim": ndim, "algo": draw(st.integers(1, 2)), "rid_len": len(rid),
              "flags": draw(_any("B")), "layer": draw(_any("i")), "seq": draw(_any("Q")),
              "token_start": draw(_any("q")), "token_end": draw(_any("q")),
              **dict(zip(("s0", "s1", "s2", "s3"), shape, strict=True)),
              "body_bytes": math.prod(shape[:ndim]) * dtype.itemsize % (1 << 64), "aux": draw(_any("Q")),
              "body_checksum": draw(_any("I")), "rid": rid}
    damaged = draw(st.sampled_from((None, *HEADER_LAYOUT)))
    if damaged is not None:
        name, code = damaged
        fields[name] = draw(st.binary(min_size=4, max_size=4) if code == "4s" else
                            st.binary(max_size=64) if code == "64s" else _any(code))
    covered = LAYOUT.pack(*(fields[name] for name, _ in HEADER_LAYOUT))
    return covered + struct.pack("<I", zlib.crc32(covered))


@fuzz(400)
@given(raw=checksummed_headers())
def test_checksummed_headers_parse_or_raise_frame_error(raw):
    try:
        header = unpack_header(raw)
    except FrameError:
        return
    # Not byte-exact: bytes past request_id_len and shape[ndim:] are ignored, and packed as zeros.
    assert unpack_header(header.pack()) == header
    if header.kind.is_data:
        assert header.body_bytes == math.prod(header.shape) * header.dtype.itemsize


@pytest.mark.parametrize(("shape", "body_bytes"), [((-1, -1), 1), ((0, -5), 0), ((-2, -3), 6)])
def test_negative_shape_dims_raise_frame_error(shape, body_bytes):
    """Found by the fuzz: dims whose product matches body_bytes reached ``as_tensor``'s view."""
    raw = FrameHeader(Kind.BLOB, "req", shape=shape, body_bytes=body_bytes, flags=FLAG_INLINE_BODY).pack()
    with pytest.raises(FrameError):
        unpack_header(raw)


class FakeTransport:
    """The little of an asyncio transport that ``FrameConnection`` calls while reading."""

    def __init__(self):
        self.paused = self.aborted = False

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False

    def abort(self):
        self.aborted = True

    def is_closing(self):
        return self.aborted


def read_stream(data: bytes, chunk_bytes: list[int], max_frame_bytes: int = 1 << 20) -> list[Frame | LinkClosed]:
    """Feeds ``data`` to a ``FrameConnection`` as the event loop would (``get_buffer`` then
    ``buffer_updated``, ``chunk_bytes`` at a time, cycled; never while reading is paused) and
    returns what it delivered, inline bodies copied and released as a consumer does."""
    conn, transport = FrameConnection(max_frame_bytes), FakeTransport()
    conn.connection_made(transport)
    delivered: list[Frame | LinkClosed] = []
    position, turn = 0, 0
    while position < len(data) and not conn.closed.is_set():
        view = conn.get_buffer(-1)
        n = min(len(view), len(data) - position, max(1, chunk_bytes[turn % len(chunk_bytes)]))
        view[:n] = data[position:position + n]
        conn.buffer_updated(n)
        position, turn = position + n, turn + 1
        # The queue is private; reading it directly keeps the test synchronous (no event loop).
        while not conn._frames.empty():
            item = conn._frames.get_nowait()
            if isinstance(item, Frame) and item.inline is not None:
                item = Frame(item.header, memoryview(bytes(item.inline)))
                conn.release()
            delivered.append(item)
        assert not transport.paused or conn.closed.is_set(), "reading paused with nothing held"
    return delivered


def _frame_bytes(header: FrameHeader, body: bytes) -> bytes:
    return header._replace(body_checksum=checksum(header.checksum_algo, body)).pack() + body


STREAM = [(control_header(Kind.SYNC, "s", seq=1), b""),
          (FrameHeader(Kind.BLOB, "b", seq=2, shape=(40,), body_bytes=40, flags=FLAG_INLINE_BODY), bytes(range(40))),
          (control_header(Kind.ABORT, "a", seq=3, payload=b"why"), b"why"),
          (FrameHeader(Kind.MLA_ROWS, "m", seq=4, dtype=DType.FLOAT32, shape=(2, 3), body_bytes=24), b"")]
STREAM_BYTES = b"".join(_frame_bytes(h, b) for h, b in STREAM)
chunks = st.lists(st.integers(1, 400), min_size=1, max_size=5)


@fuzz(200)
@given(raw=st.binary(max_size=1000), chunk_bytes=chunks)
def test_stream_of_random_bytes_closes_with_protocol_error(raw, chunk_bytes):
    delivered = read_stream(raw, chunk_bytes)
    if len(raw) < HEADER_BYTES:
        assert delivered == []
    else:
        assert len(delivered) == 1 and isinstance(delivered[0], LinkClosed), delivered
        assert delivered[0].reason.startswith("protocol error"), delivered[0].reason


@fuzz(300)
@given(position=st.integers(0, len(STREAM_BYTES) - 1), xor=st.integers(1, 255), chunk_bytes=chunks)
def test_damaged_stream_delivers_good_frames_then_stops(position, xor, chunk_bytes):
    """A damaged header ends the connection right there; a damaged body is delivered as sent
    and fails its checksum (which the receiver verifies)."""
    delivered = read_stream(_flip(STREAM_BYTES, position, xor), chunk_bytes)
    starts = [0]
    for _, body in STREAM:
        starts.append(starts[-1] + HEADER_BYTES + len(body))
    hit = max(i for i, start in enumerate(starts[:-1]) if start <= position)
    in_header = position - starts[hit] < HEADER_BYTES
    frames = [d for d in delivered if isinstance(d, Frame)]
    good = [(h.describe(), b) for h, b in STREAM]
    got = [(f.header.describe(), bytes(f.inline or b"")) for f in frames]
    if in_header:
        assert got == good[:hit]
        assert isinstance(delivered[-1], LinkClosed) and delivered[-1].reason.startswith("protocol error")
    else:
        assert [g[0] for g in got] == [g[0] for g in good] and not any(isinstance(d, LinkClosed) for d in delivered)
        damaged = frames[hit]
        assert checksum(damaged.header.checksum_algo, damaged.inline) != damaged.header.body_checksum


@fuzz(50)
@given(body_bytes=st.integers((1 << 20) + 1, (1 << 63) - 1))
def test_oversized_body_is_refused_before_allocation(body_bytes):
    header = FrameHeader(Kind.BLOB, "big", shape=(body_bytes,), body_bytes=body_bytes, flags=FLAG_INLINE_BODY)
    tracemalloc.start()
    try:
        delivered = read_stream(header.pack() + b"x" * 100, [4096], max_frame_bytes=1 << 20)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(delivered) == 1 and "exceeds max_frame_bytes" in delivered[0].reason
    assert peak_bytes < 512 << 10, f"{peak_bytes} bytes allocated to refuse a {body_bytes}-byte body"
