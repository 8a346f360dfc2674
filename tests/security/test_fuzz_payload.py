"""Fuzzing with hypothesis of the block payload codec (``payload_format.decode``).

Random, damaged and CRC-consistent but nonsensical encodings raise ``PayloadError``, without
allocating what a header claims.

Every run is derandomized (CI sees the same examples each time) and keeps no example database
(``fuzz_support.fuzz``).
"""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstore import payload_format as codec
from kvstore.payload import make_random_payload
from tests.security.fuzz_support import fuzz, mutate

PAYLOADS = (
    make_random_payload(torch.Generator().manual_seed(1), block_size=4, latent_dim=8),
    make_random_payload(torch.Generator().manual_seed(2), mla_layer_ids=(0,), kda_layer_ids=(1, 2),
                        block_size=2, latent_dim=4, dtype=torch.bfloat16),
)
ENCODED = tuple(codec.encode(p) for p in PAYLOADS)
FIELDS = codec._FIXED_FIELDS  # the fixed header's field names in byte order
FIXED = codec._FIXED
HEADER_CRC_AT = codec._HEADER_CRC_OFFSET
MIB = 1 << 20


def decode_bounded(buf: bytes | bytearray, limit_bytes: int = 4 * MIB, verify_checksum: bool = True):
    """``codec.decode``, asserting it allocated at most ``limit_bytes`` beyond a copy of ``buf``
    (tensors are views of that copy, or of ``buf`` itself when it is writable)."""
    tracemalloc.start()
    try:
        return codec.decode(buf, verify_checksum=verify_checksum)
    finally:
        peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak_bytes < limit_bytes + len(buf), f"decoding {len(buf)} bytes allocated {peak_bytes}"


@fuzz(300)
@given(raw=st.one_of(st.binary(max_size=600), st.binary(max_size=600).map(lambda b: codec.MAGIC + b)))
def test_random_bytes_raise_payload_error(raw):
    with pytest.raises(codec.PayloadError):
        decode_bounded(raw)


@fuzz(300)
@given(which=st.sampled_from([0, 1]), position=st.integers(0, 10_000), new=st.binary(min_size=1, max_size=8),
       cut=st.integers(0, 300), extra=st.binary(max_size=3))
def test_damaged_payloads_raise_payload_error(which, position, new, cut, extra):
    raw = mutate(ENCODED[which], position, new, cut) + extra
    if raw == ENCODED[which]:
        assert decode_bounded(raw).same_as(PAYLOADS[which])
    else:
        with pytest.raises(codec.PayloadError):
            decode_bounded(raw)


def _rewrite(encoded: bytes, changes: dict[str, int], fix_body_bytes: bool) -> bytearray:
    """``encoded`` with fixed header fields replaced and the header checksum recomputed (with
    ``fix_body_bytes``, body_bytes made to match the new shapes too)."""
    buf = bytearray(encoded)
    fields = dict(zip(FIELDS, FIXED.unpack_from(buf), strict=True)) | changes
    if fix_body_bytes:
        head = codec.PayloadHeader(**{k: v for k, v in fields.items() if k not in ("magic", "version")})
        with contextlib.suppress(codec.PayloadError):  # an unknown dtype: leave body_bytes
            fields["body_bytes"] = head.expected_body_bytes() % (1 << 64)
    FIXED.pack_into(buf, 0, *(fields[name] for name in FIELDS))
    header_bytes = min(fields["header_bytes"], len(buf))
    struct.pack_into("<I", buf, HEADER_CRC_AT, 0)
    struct.pack_into("<I", buf, HEADER_CRC_AT, zlib.crc32(buf[:header_bytes]))
    return buf


U16, U32 = st.integers(0, 0xFFFF), st.integers(0, 0xFFFF_FFFF)
SMALL_OR_U16 = st.one_of(st.integers(0, 4), U16)
FIELD_VALUES = {"flags": U16, "header_bytes": st.one_of(st.sampled_from([64, 128, 192]), U32),
                "body_bytes": st.integers(0, (1 << 64) - 1), "fingerprint_len": st.one_of(st.integers(0, 80), U16),
                "num_mla_layers": SMALL_OR_U16, "num_kda_layers": SMALL_OR_U16,
                **{name: st.integers(0, 255) for name in ("mla_dtype", "state_dtype", "conv_dtype")},
                **{name: st.one_of(st.integers(0, 16), U32) for name in
                   ("block_size", "latent_dim", "kda_heads", "kda_key_dim", "kda_value_dim", "conv_rows",
                    "conv_channels")}}


@fuzz(400)
@given(which=st.sampled_from([0, 1]), fix_body_bytes=st.booleans(), verify_checksum=st.booleans(),
       changes=st.lists(st.sampled_from(sorted(FIELD_VALUES)), unique=True, max_size=4).flatmap(
           lambda names: st.fixed_dictionaries({name: FIELD_VALUES[name] for name in names})))
def test_checksummed_nonsense_headers_raise_payload_error(which, fix_body_bytes, verify_checksum, changes):
    """Field values a buggy writer could produce, with a correct header checksum: refused with
    PayloadError and without allocating what the header claims, or decoded to a payload that
    round-trips."""
    buf = _rewrite(ENCODED[which], changes, fix_body_bytes)
    try:
        payload = decode_bounded(buf, limit_bytes=MIB, verify_checksum=verify_checksum)
    except codec.PayloadError:
        return
    # Not byte-exact: flag bits but the snapshot's, and header bytes past the layer ids, are ignored.
    assert codec.decode(codec.encode(payload)).same_as(payload)


def test_kda_layers_without_snapshot_raise_payload_error():
    with pytest.raises(codec.PayloadError):
        codec.decode(_rewrite(ENCODED[0], {"num_kda_layers": 1}, fix_body_bytes=False))


@pytest.mark.parametrize("verify_checksum", [True, False])
def test_a_huge_claimed_tensor_is_refused_without_allocating(verify_checksum):
    """A header claiming 8 TiB of MLA rows (shapes and body_bytes consistent, checksum right)."""
    buf = _rewrite(ENCODED[0], {"block_size": 1 << 20, "latent_dim": 1 << 20}, fix_body_bytes=True)
    assert codec.read_header(buf, complete=False).body_bytes == 2 * (1 << 40) * 4
    tracemalloc.start()
    try:
        with pytest.raises(codec.PayloadError, match="truncated"):
            codec.decode(bytes(buf), verify_checksum=verify_checksum)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_bytes < MIB, peak_bytes
