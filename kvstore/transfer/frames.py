"""Frame layout of the transfer engine: the fixed-size header, frame kinds, dtype codes and
body checksums. Pure functions and frozen values; no I/O, no threads, no torch import.

Every frame is one 160-byte header, optionally followed by ``body_bytes`` of body on the same
stream (``FLAG_INLINE_BODY``; with ``FLAG_TRAILING_CHECKSUM`` the body's checksum follows it in
4 bytes instead of sitting in the header); otherwise the body travels out of band (shm ring, UCX tag) and
``aux`` tells the backend where, or it was written straight into the receiver's destination
(``FLAG_DIRECT``, see ``placement``), where the receiver verifies it. All integers are
little-endian::

    offset size  field
       0    4    magic            b"TKV1"
       4    2    version          FRAME_VERSION
       6    1    kind             Kind
       7    1    dtype            DType code of the body elements
       8    1    ndim             0..MAX_NDIM; shape[ndim:] is zero
       9    1    checksum_algo    ChecksumAlgo of body_checksum
      10    1    request_id_len   bytes of request_id used (utf-8)
      11    1    flags            FLAG_INLINE_BODY, FLAG_DIRECT, FLAG_TRAILING_CHECKSUM
      12    4    layer            model layer index; blob index for BLOB; layer count for END
      16    8    seq              per-connection sequence number (ACK: every data frame up to it)
      24    8    token_start      first token of the chunk
      32    8    token_end        one past the last token
      40   32    shape            4 x i64 element shape of the body
      72    8    body_bytes       body length
      80    8    aux              shm ring offset of the body (not FLAG_DIRECT)
      88    4    body_checksum    checksum of the body bytes
      92   64    request_id       utf-8, zero padded
     156    4    header_crc       zlib.crc32 of bytes [0, 156)
"""

from __future__ import annotations

import enum
import math
import struct
import zlib
from typing import NamedTuple

try:  # ISA-L's CRC-32 (zlib's polynomial, folded with (V)PCLMULQDQ): at memory speed, ~2x crc32c here
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - depends on the environment
    _crc32 = zlib.crc32
    _HARDWARE_CRC32 = False
else:
    _HARDWARE_CRC32 = True
try:  # hardware CRC32C (SSE4.2 crc32 instruction), ~5x faster than zlib.crc32; optional
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - depends on the environment
    _crc32c = None

MAGIC = b"TKV1"
# 3: every stream connection opens with the AUTH exchange (``auth``); 4: which names, and is
# bound to, the link's encryption
FRAME_VERSION = 4
MAX_NDIM = 4
REQUEST_ID_MAX_BYTES = 64
FLAG_INLINE_BODY = 0x01
FLAG_DIRECT = 0x02  # the body is already in the receiver's destination (shm direct placement)
# The inline body is followed by its 4-byte checksum (little-endian) and body_checksum is 0: the
# sender checksums each piece just before it writes it (tcp data frames, ``writer``).
FLAG_TRAILING_CHECKSUM = 0x04
TRAILER = struct.Struct("<I")

_BODY_FMT = "<4sHBBBBBBiQqq4qQQI64s"
_HEADER_STRUCT = struct.Struct(_BODY_FMT + "I")
_CRC_COVERED = struct.calcsize(_BODY_FMT)
HEADER_BYTES = _HEADER_STRUCT.size
assert HEADER_BYTES == 160


class FrameError(ValueError):
    """A header or body that cannot be a valid frame (bad magic, crc, lengths)."""


class Kind(enum.IntEnum):
    """What a frame carries. Data kinds go sender -> receiver; replies go back."""

    MLA_ROWS = 1  # rows [token_end - token_start, latent_dim] of one MLA layer
    KDA_STATE = 2  # final recurrent state [H, K, V] of one KDA layer
    KDA_CONV = 3  # final short-conv window [kernel - 1, channels] of one KDA layer
    BLOB = 4  # opaque bytes (an encoded cache block); layer = blob index
    END = 16  # sender finished the request; layer = number of layers it pushed
    ABORT = 17  # sender gave up on the request; body = utf-8 reason
    HELLO = 18  # connection handshake; body = backend-specific bytes
    OPEN = 19  # sender asks where the request's chunks may be written directly (shm); answered by PLACE
    REVOKED = 20  # sender will write nothing more into the request's placement (answers an ERROR)
    AUTH = 21  # connection authentication, both ways, before any other frame; body: see ``auth``
    SYNC = 22  # sender asks for a SYNCED once the receiver has processed every earlier frame
    ACK = 32  # receiver consumed every data frame up to `seq` (cumulative)
    ERROR = 33  # receiver failed the request; body = utf-8 reason
    DONE = 34  # receiver holds the complete request
    PLACE = 35  # answer to OPEN; body = packed placement.PagePlacement, or empty for "use the ring"
    SYNCED = 36  # answer to SYNC (same seq): every frame before it has been processed

    @property
    def is_data(self) -> bool:
        return self in DATA_KINDS


DATA_KINDS = frozenset({Kind.MLA_ROWS, Kind.KDA_STATE, Kind.KDA_CONV, Kind.BLOB})
_KIND_OF = {k.value: k for k in Kind}


class DType(enum.IntEnum):
    """Element types of a body; names match torch and numpy (bfloat16 has no numpy type)."""

    UINT8 = 1
    INT8 = 2
    INT16 = 3
    INT32 = 4
    INT64 = 5
    FLOAT16 = 6
    BFLOAT16 = 7
    FLOAT32 = 8
    FLOAT64 = 9

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @classmethod
    def from_name(cls, name: object) -> DType:
        """``DType`` of a dtype given as a name, a numpy dtype or a torch dtype (cached: every
        frame a sender builds asks)."""
        found = _BY_NAME.get(name)
        if found is not None:
            return found
        text = str(name).removeprefix("torch.")
        try:
            found = cls[text.upper()]
        except KeyError:
            raise ValueError(f"unsupported dtype {name!r}; supported: {[d.name.lower() for d in cls]}") from None
        _BY_NAME[name] = found
        return found


_BY_NAME: dict[object, DType] = {}  # dtype objects and names seen by DType.from_name


_ITEMSIZE = {
    DType.UINT8: 1,
    DType.INT8: 1,
    DType.INT16: 2,
    DType.INT32: 4,
    DType.INT64: 8,
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FLOAT64: 8,
}


class ChecksumAlgo(enum.IntEnum):
    CRC32 = 1  # zlib's CRC-32, always available; computed by ISA-L (isal) where installed
    CRC32C = 2  # crc32c package (hardware crc32 instruction)
    AEAD = 3  # no checksum: the encrypted link's AES-GCM tag authenticates the body (``aead``)


_DTYPE_OF = {d.value: d for d in DType}
_ALGO_OF = {a.value: a for a in ChecksumAlgo}


def default_checksum_algo() -> ChecksumAlgo:
    """The fastest checksum here: CRC32 when ISA-L computes it (carry-less multiply folding, about
    60 GB/s in cache on this project's machines, twice the crc32 instruction's rate), else CRC32C
    when the ``crc32c`` package is importable, else zlib's CRC32. A receiver verifies whichever
    algorithm a frame names."""
    if _HARDWARE_CRC32:
        return ChecksumAlgo.CRC32
    return ChecksumAlgo.CRC32C if _crc32c is not None else ChecksumAlgo.CRC32


def checksum(algo: ChecksumAlgo, body, value: int = 0, hold_gil: bool = False) -> int:
    """Checksum of ``body`` (a contiguous byte buffer), continuing from ``value`` (the checksum of
    the bytes before it), so a body can be checksummed piece by piece as it is copied or
    received. Both algorithms release the GIL on large inputs unless ``hold_gil`` (crc32c only:
    for a small body, handing the GIL to another thread and back costs more than the checksum)."""
    if algo == ChecksumAlgo.AEAD:
        return 0  # checked by the link's tag, which only an encrypted link accepts (``connection``)
    if algo == ChecksumAlgo.CRC32C:
        if _crc32c is None:
            raise FrameError("frame uses crc32c but the crc32c package is not installed here")
        return _crc32c.crc32c(body, value, 0 if hold_gil else -1)
    return _crc32(body, value)


class FrameHeader(NamedTuple):
    """One frame's header; see the module docstring for the byte layout.

    An immutable NamedTuple rather than a frozen dataclass: every frame builds, copies
    (``_replace``) and parses one, and a tuple does that several times faster.
    """

    kind: Kind
    request_id: str
    seq: int = 0
    layer: int = 0
    token_start: int = 0
    token_end: int = 0
    dtype: DType = DType.UINT8
    shape: tuple[int, ...] = ()
    body_bytes: int = 0
    aux: int = 0
    body_checksum: int = 0
    checksum_algo: ChecksumAlgo = ChecksumAlgo.CRC32
    flags: int = 0

    @property
    def inline_body(self) -> bool:
        return bool(self.flags & FLAG_INLINE_BODY) and self.body_bytes > 0

    def describe(self) -> str:
        """Short text naming the frame, for error messages."""
        text = f"{self.kind.name} request {self.request_id!r} seq {self.seq}"
        if self.kind.is_data:
            text += f" layer {self.layer} tokens [{self.token_start}, {self.token_end})"
        return text

    def pack(self) -> bytes:
        rid = self.request_id.encode()
        if len(rid) > REQUEST_ID_MAX_BYTES:
            raise ValueError(f"request id is {len(rid)} bytes utf-8, limit {REQUEST_ID_MAX_BYTES}")
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"shape {self.shape} has {len(self.shape)} dims, limit {MAX_NDIM}")
        shape = tuple(self.shape) + (0,) * (MAX_NDIM - len(self.shape))
        fields = (
            MAGIC,
            FRAME_VERSION,
            int(self.kind),
            int(self.dtype),
            len(self.shape),
            int(self.checksum_algo),
            len(rid),
            self.flags,
            self.layer,
            self.seq,
            self.token_start,
            self.token_end,
            *shape,
            self.body_bytes,
            self.aux,
            self.body_checksum,
            rid,
        )
        covered = struct.pack(_BODY_FMT, *fields)
        return covered + struct.pack("<I", zlib.crc32(covered))


def unpack_header(buf: bytes | bytearray | memoryview) -> FrameHeader:
    """Parse and validate one header; raises ``FrameError`` naming what is wrong."""
    if len(buf) != HEADER_BYTES:
        raise FrameError(f"header is {len(buf)} bytes, expected {HEADER_BYTES}")
    (magic, version, kind, dtype, ndim, algo, rid_len, flags, layer, seq, t0, t1, s0, s1, s2, s3,
     body_bytes, aux, body_crc, rid, header_crc) = _HEADER_STRUCT.unpack(buf)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {magic!r}, expected {MAGIC!r} (stream out of sync?)")
    if version != FRAME_VERSION:
        raise FrameError(f"frame version {version}, this build speaks {FRAME_VERSION}")
    actual_crc = zlib.crc32(memoryview(buf)[:_CRC_COVERED])
    if actual_crc != header_crc:
        raise FrameError(f"header checksum mismatch: header says {header_crc:#010x}, computed {actual_crc:#010x}")
    if ndim > MAX_NDIM or rid_len > REQUEST_ID_MAX_BYTES:
        raise FrameError(f"header has ndim {ndim} / request id length {rid_len} beyond limits")
    # Enum members by value through dicts: Enum.__call__ costs more than the rest of a parse.
    try:
        header = FrameHeader(
            _KIND_OF[kind],
            rid[:rid_len].decode(),
            seq,
            layer,
            t0,
            t1,
            _DTYPE_OF[dtype],
            (s0, s1, s2, s3)[:ndim],
            body_bytes,
            aux,
            body_crc,
            _ALGO_OF[algo],
            flags,
        )
    except KeyError as exc:
        raise FrameError(f"invalid header field: unknown code {exc}") from exc
    except UnicodeDecodeError as exc:
        raise FrameError(f"invalid header field: {exc}") from exc
    if any(d < 0 for d in header.shape):
        raise FrameError(f"{header.describe()}: negative dimension in shape {header.shape}")
    if header.kind in DATA_KINDS:
        expected_bytes = math.prod(header.shape) * header.dtype.itemsize
        if expected_bytes != body_bytes:
            raise FrameError(
                f"{header.describe()}: body_bytes {body_bytes} != {header.dtype.name.lower()} "
                f"shape {header.shape} = {expected_bytes} bytes"
            )
    return header


def control_header(
    kind: Kind, request_id: str, *, seq: int = 0, layer: int = 0, aux: int = 0, payload: bytes = b""
) -> FrameHeader:
    """Header of a control or reply frame whose small ``payload`` rides inline."""
    algo = ChecksumAlgo.CRC32
    return FrameHeader(
        kind=kind,
        request_id=request_id,
        seq=seq,
        layer=layer,
        aux=aux,
        body_bytes=len(payload),
        shape=(len(payload),),
        body_checksum=zlib.crc32(payload),
        checksum_algo=algo,
        flags=FLAG_INLINE_BODY,
    )
