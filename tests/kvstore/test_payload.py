"""Block keys and payload encoding: stability, isolation, round trips and rejection of every
kind of damaged buffer."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from kvstore.blocks import ROOT_KEY, block_key, chain_keys
from kvstore.payload import BlockPayload, make_random_payload
from kvstore.payload_format import (
    ALIGN_BYTES,
    PayloadError,
    decode,
    encode,
    encode_parts,
    encoded_nbytes,
    read_header,
    verify,
)

FP = "kimi-linear-tiny"


def _payload(seed: int = 0, snapshot: bool = False, dtype: torch.dtype = torch.float32) -> BlockPayload:
    return make_random_payload(
        torch.Generator().manual_seed(seed),
        model_fingerprint=FP,
        mla_layer_ids=(3, 7),
        block_size=4,
        latent_dim=6,
        kda_layer_ids=(0, 1, 2) if snapshot else (),
        dtype=dtype,
    )


# ----- keys ------------------------------------------------------------------------------


def test_block_key_is_stable_across_processes_and_versions() -> None:
    # A changed digest means every cache on disk and in every index is silently orphaned.
    keys = chain_keys(list(range(8)), 4, FP)
    assert keys[1].hex() == "fecf1a09f70acd09ae05544917cba244"
    assert keys[1] == block_key(block_key(ROOT_KEY, [0, 1, 2, 3], FP), [4, 5, 6, 7], FP)


def test_salt_and_model_isolate_keys() -> None:
    tokens = list(range(12))
    base = chain_keys(tokens, 4, FP)
    assert chain_keys(tokens, 4, FP, "tenant-a") != base
    assert chain_keys(tokens, 4, FP, "tenant-a")[1].hex() != base[1].hex()
    assert set(chain_keys(tokens, 4, "other-model")).isdisjoint(base)
    assert set(chain_keys(tokens, 4, FP, "tenant-a")).isdisjoint(chain_keys(tokens, 4, FP, "tenant-b"))
    assert chain_keys(tokens, 4, FP, "tenant-a") == chain_keys(tokens, 4, FP, "tenant-a")


def test_keys_chain_on_the_whole_prefix() -> None:
    a = chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, FP)
    b = chain_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, FP)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert len(chain_keys(list(range(11)), 4, FP)) == 2  # the partial block has no key


# ----- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("snapshot", [False, True])
def test_round_trip(dtype: torch.dtype, snapshot: bool) -> None:
    payload = _payload(1, snapshot, dtype)
    buf = encode(payload)
    assert len(buf) == encoded_nbytes(payload)
    assert b"".join(encode_parts(payload)) == buf
    out = decode(buf, expected_fingerprint=FP)
    assert out.same_as(payload)
    assert out.mla.dtype == dtype and out.has_snapshot == snapshot
    assert out.mla_layer_ids == (3, 7)
    assert out.kda_layer_ids == ((0, 1, 2) if snapshot else ())
    head = read_header(buf)
    assert head.header_bytes % ALIGN_BYTES == 0
    assert head.model_fingerprint == FP and head.has_snapshot == snapshot


def test_encoding_is_stable() -> None:
    # Blocks persist on SSD across upgrades: a changed layout must bump VERSION, never drift.
    payload = BlockPayload(
        FP,
        torch.arange(2 * 4 * 6, dtype=torch.float32).view(2, 4, 6),
        (3, 7),
        torch.arange(32, dtype=torch.float32).view(1, 2, 4, 4),
        torch.arange(9, dtype=torch.float32).view(1, 3, 3),
        (0,),
    )
    buf = encode(payload)
    assert (len(buf), zlib.crc32(buf)) == (484, 0xD8E9F505)
    assert buf[:16].hex() == "54444b56424c4b000100010080000000"  # magic, version 1, flags, header_bytes 128


def test_nbytes_counts_tensor_data() -> None:
    payload = _payload(snapshot=True)
    # mla 2*4*6 fp32, state 3*2*4*4 fp32, conv 3*3*24 fp32
    assert payload.nbytes == 4 * (2 * 4 * 6 + 3 * 2 * 4 * 4 + 3 * 3 * 24)
    assert encoded_nbytes(payload) > payload.nbytes


def test_decode_of_bytes_copies_and_of_bytearray_shares() -> None:
    payload = _payload()
    frozen = encode(payload)
    owned = decode(frozen)
    owned.mla.zero_()  # must not write into the immutable bytes
    assert decode(frozen).same_as(payload)
    shared_buf = bytearray(frozen)
    shared = decode(shared_buf)
    shared.mla.add_(1.0)
    with pytest.raises(PayloadError, match="body checksum"):
        verify(shared_buf)


def test_non_contiguous_tensors_encode_like_contiguous_ones() -> None:
    payload = _payload()
    transposed = payload.mla.transpose(1, 2).contiguous().transpose(1, 2)
    assert not transposed.is_contiguous()
    other = BlockPayload(FP, transposed, payload.mla_layer_ids)
    assert encode(other) == encode(payload)


def test_payload_rejects_inconsistent_fields() -> None:
    mla = torch.zeros(2, 4, 6)
    with pytest.raises(ValueError, match="2 layers but 3 layer ids"):
        BlockPayload(FP, mla, (0, 1, 2))
    with pytest.raises(ValueError, match="together"):
        BlockPayload(FP, mla, (0, 1), kda_state=torch.zeros(1, 2, 4, 4), kda_layer_ids=(0,))
    with pytest.raises(ValueError, match="dtype"):
        BlockPayload(FP, mla.to(torch.int32), (0, 1))
    with pytest.raises(ValueError, match="3 dims"):
        BlockPayload(FP, torch.zeros(2, 24), (0, 1))


# ----- rejection -------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [0, 10, 69, 70, 100, -1, -50])
def test_truncated_buffer_is_rejected(cut: int) -> None:
    buf = encode(_payload(snapshot=True))
    with pytest.raises(PayloadError, match="truncated"):
        decode(buf[:cut])


def test_every_single_bit_flip_is_rejected() -> None:
    buf = encode(_payload(2, snapshot=True, dtype=torch.bfloat16))
    for pos in range(len(buf)):
        damaged = bytearray(buf)
        damaged[pos] ^= 1 << (pos % 8)
        with pytest.raises(PayloadError):
            decode(damaged)


def test_rejections_name_the_defect() -> None:
    buf = encode(_payload(snapshot=True))
    head = read_header(buf)
    with pytest.raises(PayloadError, match="body checksum mismatch"):
        decode(buf[:-1] + bytes([buf[-1] ^ 0xFF]))
    with pytest.raises(PayloadError, match="header checksum mismatch"):
        decode(buf[:80] + bytes([buf[80] ^ 1]) + buf[81:])
    with pytest.raises(PayloadError, match="bad magic"):
        decode(b"X" + buf[1:])
    with pytest.raises(PayloadError, match="version"):
        decode(buf[:8] + struct.pack("<H", 99) + buf[10:])
    with pytest.raises(PayloadError, match="trailing"):
        decode(buf + b"\0")
    with pytest.raises(PayloadError, match="wrong model fingerprint 'kimi-linear-tiny'"):
        decode(buf, expected_fingerprint="other-model")
    with pytest.raises(PayloadError, match="wrong model fingerprint"):
        decode(buf, expected_fingerprint="other-model", verify_checksum=False)
    assert isinstance(PayloadError("x"), ValueError)
    assert head.total_bytes == len(buf)


def test_skipping_the_body_checksum_still_checks_the_header() -> None:
    buf = bytearray(encode(_payload()))
    buf[-1] ^= 1
    assert decode(buf, verify_checksum=False).mla.shape == (2, 4, 6)  # body trusted
    buf[20] ^= 1
    with pytest.raises(PayloadError):
        decode(buf, verify_checksum=False)
