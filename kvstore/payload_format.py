"""The binary layout of block payloads: the byte format every tier, file and transfer uses.

Owns encoding a ``BlockPayload`` (``encode``, ``encode_parts``, ``encoded_nbytes``) and reading
it back with every check (``read_header``, ``verify``, ``decode``, ``PayloadHeader``,
``PayloadError``), the header's fields, the dtype code table's reverse and the alignment. No
pickle: a fixed little-endian header followed by the raw tensor bytes. A model without KDA
layers carries an empty snapshot (zero layers, zero bytes) on every block: the flag says the
block is resumable, as it does for the hybrid. The payload value and its checks live in
``kvstore.payload``.

Layout (all integers little-endian; offsets in bytes)::

    0        fixed header (70 bytes, fields in ``_FIXED_LAYOUT`` order)
    70       fingerprint          utf-8, fingerprint_len bytes
    ...      mla_layer_ids        u16 x num_mla_layers
    ...      kda_layer_ids        u16 x num_kda_layers
    ...      zero padding up to header_bytes (a multiple of 64)
    header_bytes                  body: body_bytes bytes, three sections, each starting
                                  at a multiple of 64 from the body start (zero padding):
        mla       [num_mla_layers, block_size, latent_dim]         mla_dtype
        kda_state [num_kda_layers, heads, key_dim, value_dim]      state_dtype (snapshot only)
        kda_conv  [num_kda_layers, conv_rows, conv_channels]       conv_dtype  (snapshot only)

Checksums are CRC-32 (``zlib.crc32``, ~2.4 GB/s here; BLAKE2b measured 0.6 GB/s): one over the
whole body (padding included) and one over the header bytes with its own field zeroed, so a
flipped bit anywhere, in a shape, a layer id or the tensor data, is caught. CRC-32 guards
against corruption (torn writes, bit rot), not against an adversary.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from functools import cache
from typing import TYPE_CHECKING

from kvstore.payload import BlockPayload, _as_bytes, _dtype_codes, _tensor_nbytes

if TYPE_CHECKING:
    import torch

MAGIC = b"TDKVBLK\x00"
VERSION = 1
ALIGN_BYTES = 64
_FLAG_SNAPSHOT = 1

# The fixed header, (field, struct code) in byte order; "" marks a padding byte.
_FIXED_LAYOUT = (
    ("magic", "8s"), ("version", "H"), ("flags", "H"), ("header_bytes", "I"), ("body_bytes", "Q"),
    ("body_crc32", "I"), ("header_crc32", "I"), ("fingerprint_len", "H"), ("num_mla_layers", "H"),
    ("num_kda_layers", "H"), ("mla_dtype", "B"), ("state_dtype", "B"), ("conv_dtype", "B"), ("", "x"),
    ("block_size", "I"), ("latent_dim", "I"), ("kda_heads", "I"), ("kda_key_dim", "I"),
    ("kda_value_dim", "I"), ("conv_rows", "I"), ("conv_channels", "I"),
)  # fmt: skip
_FIXED = struct.Struct("<" + "".join(code for _, code in _FIXED_LAYOUT))
_FIXED_FIELDS = tuple(name for name, _ in _FIXED_LAYOUT if name)
_HEADER_CRC_OFFSET = struct.calcsize("<8sHHIQI")  # where header_crc32 starts


@cache
def _code_dtypes() -> dict[int, torch.dtype]:
    return {code: dtype for dtype, code in _dtype_codes().items()}


class PayloadError(ValueError):
    """An encoded payload is malformed: truncated, corrupted, or for another model."""


def _align(n_bytes: int) -> int:
    return -(-n_bytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclasses.dataclass(frozen=True)
class PayloadHeader:
    """The parsed fixed header plus its variable part; sizes in bytes."""

    flags: int
    header_bytes: int
    body_bytes: int
    body_crc32: int
    header_crc32: int
    fingerprint_len: int
    num_mla_layers: int
    num_kda_layers: int
    mla_dtype: int
    state_dtype: int
    conv_dtype: int
    block_size: int
    latent_dim: int
    kda_heads: int
    kda_key_dim: int
    kda_value_dim: int
    conv_rows: int
    conv_channels: int
    model_fingerprint: str = ""
    mla_layer_ids: tuple[int, ...] = ()
    kda_layer_ids: tuple[int, ...] = ()

    @property
    def has_snapshot(self) -> bool:
        return bool(self.flags & _FLAG_SNAPSHOT)

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.body_bytes

    def sections(self) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
        """(name, dtype, shape, offset from body start) of each tensor section, in body order."""
        shapes = [("mla", self.mla_dtype, (self.num_mla_layers, self.block_size, self.latent_dim))]
        if self.has_snapshot:
            state = (self.num_kda_layers, self.kda_heads, self.kda_key_dim, self.kda_value_dim)
            shapes.append(("kda_state", self.state_dtype, state))
            shapes.append(("kda_conv", self.conv_dtype, (self.num_kda_layers, self.conv_rows, self.conv_channels)))
        out, offset = [], 0
        for name, code, shape in shapes:
            if code not in _code_dtypes():
                raise PayloadError(f"{name}: unknown dtype code {code}")
            dtype = _code_dtypes()[code]
            out.append((name, dtype, shape, offset))
            offset = _align(offset + _numel(shape) * dtype.itemsize)
        return out

    def expected_body_bytes(self) -> int:
        _, dtype, shape, offset = self.sections()[-1]
        return offset + _numel(shape) * dtype.itemsize


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _body_parts(payload: BlockPayload) -> list[memoryview]:
    """Tensor bytes and zero padding in body order (see the layout in the module docstring)."""
    parts: list[memoryview] = []
    offset = 0
    for t in (payload.mla, payload.kda_state, payload.kda_conv):
        if t is None:
            continue
        if offset % ALIGN_BYTES:
            pad = _align(offset) - offset
            parts.append(memoryview(bytes(pad)))
            offset += pad
        view = memoryview(_as_bytes(t).numpy())
        parts.append(view)
        offset += view.nbytes
    return parts


def _header_bytes(payload: BlockPayload, body_bytes: int, body_crc32: int) -> bytes:
    fp = payload.model_fingerprint.encode()
    state, conv = payload.kda_state, payload.kda_conv
    codes = _dtype_codes()
    fields = {
        "magic": MAGIC,
        "version": VERSION,
        "flags": _FLAG_SNAPSHOT if payload.has_snapshot else 0,
        "header_bytes": 0,
        "body_bytes": body_bytes,
        "body_crc32": body_crc32,
        "header_crc32": 0,
        "fingerprint_len": len(fp),
        "num_mla_layers": len(payload.mla_layer_ids),
        "num_kda_layers": len(payload.kda_layer_ids),
        "mla_dtype": codes[payload.mla.dtype],
        "state_dtype": codes[state.dtype] if state is not None else 0,
        "conv_dtype": codes[conv.dtype] if conv is not None else 0,
        "block_size": payload.mla.shape[1],
        "latent_dim": payload.mla.shape[2],
        "kda_heads": state.shape[1] if state is not None else 0,
        "kda_key_dim": state.shape[2] if state is not None else 0,
        "kda_value_dim": state.shape[3] if state is not None else 0,
        "conv_rows": conv.shape[1] if conv is not None else 0,
        "conv_channels": conv.shape[2] if conv is not None else 0,
    }
    ids = payload.mla_layer_ids + payload.kda_layer_ids
    variable = fp + struct.pack(f"<{len(ids)}H", *ids)
    fields["header_bytes"] = _align(_FIXED.size + len(variable))
    header = bytearray(fields["header_bytes"])
    _FIXED.pack_into(header, 0, *(fields[name] for name in _FIXED_FIELDS))
    header[_FIXED.size : _FIXED.size + len(variable)] = variable
    struct.pack_into("<I", header, _HEADER_CRC_OFFSET, zlib.crc32(header))
    return bytes(header)


def encode_parts(payload: BlockPayload) -> list[memoryview]:
    """The encoded payload as buffers to write in order (tensor data is not copied when it is
    already contiguous on the CPU). The views stay valid while the payload's tensors do."""
    body = _body_parts(payload)
    crc = 0
    for part in body:
        crc = zlib.crc32(part, crc)
    body_bytes = sum(part.nbytes for part in body)
    return [memoryview(_header_bytes(payload, body_bytes, crc)), *body]


def encode(payload: BlockPayload) -> bytes:
    """The encoded payload as one immutable buffer."""
    return b"".join(encode_parts(payload))


def encoded_nbytes(payload: BlockPayload) -> int:
    """Length of ``encode(payload)`` without encoding it."""
    ids = len(payload.mla_layer_ids) + len(payload.kda_layer_ids)
    header = _align(_FIXED.size + len(payload.model_fingerprint.encode()) + 2 * ids)
    body, offset = 0, 0
    for t in (payload.mla, payload.kda_state, payload.kda_conv):
        if t is not None:
            offset = _align(body)
            body = offset + _tensor_nbytes(t)
    return header + body


def read_header(buf: bytes | bytearray | memoryview, *, complete: bool = True) -> PayloadHeader:
    """Parse and check the header (magic, version, header checksum, lengths) of an encoded
    payload; the body checksum is not verified. Raises ``PayloadError``. With
    ``complete=False`` ``buf`` may hold just the header (the first part of ``encode_parts``)."""
    view = memoryview(buf).cast("B")
    if view.nbytes < _FIXED.size:
        raise PayloadError(f"truncated: {view.nbytes} bytes, the fixed header alone is {_FIXED.size}")
    raw = dict(zip(_FIXED_FIELDS, _FIXED.unpack_from(view), strict=True))
    if raw.pop("magic") != MAGIC:
        raise PayloadError(f"bad magic {bytes(view[:8])!r}, expected {MAGIC!r}")
    version = raw.pop("version")
    if version != VERSION:
        raise PayloadError(f"unsupported payload version {version}, this build reads {VERSION}")
    header_bytes = raw["header_bytes"]
    if header_bytes < _FIXED.size or header_bytes % ALIGN_BYTES or header_bytes > view.nbytes:
        raise PayloadError(f"truncated or bad header: header_bytes={header_bytes}, buffer has {view.nbytes}")
    header = bytearray(view[:header_bytes])
    struct.pack_into("<I", header, _HEADER_CRC_OFFSET, 0)
    crc = zlib.crc32(header)
    if crc != raw["header_crc32"]:
        raise PayloadError(f"header checksum mismatch: stored {raw['header_crc32']:#010x}, computed {crc:#010x}")
    return _parse_variable(raw, view, complete)


def _parse_variable(raw: dict, view: memoryview, complete: bool) -> PayloadHeader:
    """Build the header from the fixed fields in ``raw`` plus the variable part, and check
    that the shapes, ``body_bytes`` and the buffer's length agree."""
    fp_end = _FIXED.size + raw["fingerprint_len"]
    num_mla = raw["num_mla_layers"]
    num_ids = num_mla + raw["num_kda_layers"]
    ids_end = fp_end + 2 * num_ids
    if ids_end > raw["header_bytes"]:
        raise PayloadError(f"header too short for its fields: needs {ids_end} bytes, has {raw['header_bytes']}")
    try:
        fingerprint = bytes(view[_FIXED.size : fp_end]).decode()
    except UnicodeDecodeError as e:
        raise PayloadError(f"model fingerprint is not utf-8: {e}") from e
    ids = struct.unpack_from(f"<{num_ids}H", view, fp_end)
    head = PayloadHeader(**raw, model_fingerprint=fingerprint, mla_layer_ids=ids[:num_mla], kda_layer_ids=ids[num_mla:])
    expected = head.expected_body_bytes()
    if head.body_bytes != expected:
        raise PayloadError(f"body_bytes {head.body_bytes} disagrees with the shapes, which need {expected}")
    if not complete:
        return head
    if view.nbytes < head.total_bytes:
        raise PayloadError(f"truncated: {view.nbytes} bytes, expected {head.total_bytes}")
    if view.nbytes > head.total_bytes:
        raise PayloadError(f"{view.nbytes - head.total_bytes} trailing bytes after the body")
    return head


def verify(buf: bytes | bytearray | memoryview, expected_fingerprint: str | None = None) -> PayloadHeader:
    """Check everything about an encoded payload without building tensors: the header as in
    ``read_header``, the model fingerprint when one is expected, and the body checksum."""
    head = read_header(buf)
    if expected_fingerprint is not None and head.model_fingerprint != expected_fingerprint:
        raise PayloadError(f"wrong model fingerprint {head.model_fingerprint!r}, expected {expected_fingerprint!r}")
    body = memoryview(buf).cast("B")[head.header_bytes :]
    crc = zlib.crc32(body)
    if crc != head.body_crc32:
        raise PayloadError(f"body checksum mismatch: stored {head.body_crc32:#010x}, computed {crc:#010x}")
    return head


def decode(
    buf: bytes | bytearray | memoryview,
    *,
    expected_fingerprint: str | None = None,
    verify_checksum: bool = True,
) -> BlockPayload:
    """Rebuild a payload from ``encode``'s bytes; raises ``PayloadError`` naming the defect.

    Zero-copy when ``buf`` is writable (the tensors then share its memory); a read-only
    buffer such as ``bytes`` is copied once, so the payload never aliases immutable storage.
    ``verify_checksum=False`` skips only the body CRC, for bytes verified moments ago.
    """
    head = verify(buf, expected_fingerprint) if verify_checksum else read_header(buf)
    if not verify_checksum and expected_fingerprint is not None and head.model_fingerprint != expected_fingerprint:
        raise PayloadError(f"wrong model fingerprint {head.model_fingerprint!r}, expected {expected_fingerprint!r}")
    view = memoryview(buf).cast("B")
    body: bytearray | memoryview = view[head.header_bytes :]
    if body.readonly:
        body = bytearray(body)
    import torch

    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, offset in head.sections():
        n = _numel(shape)
        flat = torch.frombuffer(body, dtype=dtype, count=n, offset=offset) if n else torch.empty(0, dtype=dtype)
        tensors[name] = flat.view(shape)
    try:
        return BlockPayload(
            model_fingerprint=head.model_fingerprint,
            mla=tensors["mla"],
            mla_layer_ids=head.mla_layer_ids,
            kda_state=tensors.get("kda_state"),
            kda_conv=tensors.get("kda_conv"),
            kda_layer_ids=head.kda_layer_ids,
        )
    except ValueError as e:  # a header whose fields agree with its checksum but not with each other
        raise PayloadError(f"inconsistent header: {e}") from e


__all__ = [
    "PayloadError",
    "PayloadHeader",
    "decode",
    "encode",
    "encode_parts",
    "encoded_nbytes",
    "read_header",
    "verify",
]
