"""Transfer engine mechanism at tiny sizes, no processes: the frame header's layout (it
round-trips and a damaged one is refused), the receiver's bookkeeping (``RequestTable``:
coverage per layer, what a truncated request is missing, overlaps and misfits refused, a
closed connection failing only its own attempt of a request, ``cancel`` waiting for a chunk
still landing), the shm ring's FIFO placement with wrap-around, and the choice of address
(shm on the same host). The shm direct placements and the fence are in
``test_transfer_shm.py``; the contract every backend keeps, across processes, is in
``test_transfer_contract.py``.
"""

from __future__ import annotations

import asyncio

import pytest

from kvstore.transfer import Expected, Kind, TransferError, pick_address
from kvstore.transfer.frames import (
    HEADER_BYTES,
    ChecksumAlgo,
    DType,
    FrameError,
    FrameHeader,
    unpack_header,
)
from kvstore.transfer.ring import ShmRing
from kvstore.transfer.stream import RequestTable

# ---- frames ---------------------------------------------------------------------------------


def test_header_round_trips_and_rejects_damage():
    header = FrameHeader(
        kind=Kind.MLA_ROWS,
        request_id="req-é",
        seq=7,
        layer=3,
        token_start=32,
        token_end=64,
        dtype=DType.FLOAT32,
        shape=(32, 64),
        body_bytes=32 * 64 * 4,
        aux=4096,
        body_checksum=0xDEADBEEF,
        checksum_algo=ChecksumAlgo.CRC32,
    )
    packed = header.pack()
    assert len(packed) == HEADER_BYTES
    assert unpack_header(packed) == header
    damaged = bytearray(packed)
    damaged[20] ^= 1
    with pytest.raises(FrameError, match="header checksum mismatch"):
        unpack_header(bytes(damaged))
    with pytest.raises(FrameError, match="bad frame magic"):
        unpack_header(b"XXXX" + packed[4:])
    wrong_len = header._replace(body_bytes=5)
    with pytest.raises(FrameError, match="body_bytes 5"):
        unpack_header(wrong_len.pack())


# ---- the receiver's bookkeeping -------------------------------------------------------------


def _rows_header(rid: str, layer: int, t0: int, t1: int, width: int = 4) -> FrameHeader:
    return FrameHeader(
        kind=Kind.MLA_ROWS,
        request_id=rid,
        layer=layer,
        token_start=t0,
        token_end=t1,
        dtype=DType.FLOAT32,
        shape=(t1 - t0, width),
        body_bytes=(t1 - t0) * width * 4,
    )


def test_request_table_tracks_coverage_and_names_what_is_missing():
    table = RequestTable()
    expected = Expected(mla_layers=(0, 1), token_start=0, token_end=8, mla_row_shape=(4,))
    table.add("r", sink=None, expected=expected, deadline_s=30)
    for t0, t1 in ((0, 4), (4, 8)):
        sink, reason = table.admit(_rows_header("r", 0, t0, t1), conn_id=1)
        assert reason is None
        table.record(_rows_header("r", 0, t0, t1))
        table.landed("r")
    table.wait_layer("r", 0, timeout_s=0)
    assert table.admit(_rows_header("r", 1, 0, 4), conn_id=1)[1] is None
    table.record(_rows_header("r", 1, 0, 4))
    table.landed("r")
    _, reason = table.admit(_rows_header("r", 1, 2, 6), conn_id=1)
    assert "overlap" in reason
    table.check_integrity()
    with pytest.raises(TransferError, match="overlap"):
        table.wait_complete("r", timeout_s=0)
    table.add("s", sink=None, expected=expected, deadline_s=30)
    table.admit(_rows_header("s", 0, 0, 8), conn_id=2)
    table.record(_rows_header("s", 0, 0, 8))
    table.landed("s")
    reason = table.finish("s", num_units=2, conn_id=2)
    assert "truncated transfer" in reason and "layer 1 has tokens []" in reason
    with pytest.raises(TransferError, match="truncated transfer"):
        table.wait_complete("s", timeout_s=0)
    assert len(table) == 0


def test_a_closed_connection_fails_its_own_attempt_of_a_request_not_a_new_one():
    """A connection that ends fails the request its last frame belonged to only while that
    request is bound to it: a new attempt under the same id (a retry) is not failed by the
    old link's end."""
    table = RequestTable()
    expected = Expected(mla_layers=(0,), token_start=0, token_end=8, mla_row_shape=(4,))
    table.add("r", sink=None, expected=expected, deadline_s=30)
    assert table.admit(_rows_header("r", 0, 0, 4), conn_id=1)[1] is None
    table.landed("r")
    table.cancel("r")  # the first attempt given up on; the retry expects the same id
    table.add("r", sink=None, expected=expected, deadline_s=30)
    assert table.fail("r", "old link closed", conn_id=1) is None
    assert table.admit(_rows_header("r", 0, 0, 8), conn_id=2)[1] is None
    assert table.fail("r", "its own link closed", conn_id=2) == 2
    with pytest.raises(TransferError, match="its own link closed"):
        table.wait_complete("r", timeout_s=0)


def test_request_table_rejects_misfits_and_unknown_requests():
    table = RequestTable()
    table.add("r", sink=None, expected=Expected(mla_layers=(0,), token_end=8, mla_row_shape=(4,)), deadline_s=30)
    assert "not expected" in table.admit(_rows_header("nobody", 0, 0, 4), conn_id=1)[1]
    assert "destination expects float32 (4, 4)" in table.admit(_rows_header("r", 0, 0, 4, width=5), conn_id=1)[1]
    table.cancel("r")
    assert len(table) == 0


def test_cancel_waits_for_a_chunk_still_landing_in_the_destination():
    """A chunk admitted and not yet landed (a body still arriving into the pages): ``cancel``
    returns only once it has, so the caller never frees memory the receiver is writing."""
    import threading

    table = RequestTable(fence_timeout_s=30.0)
    table.add("r", sink=None, expected=Expected(mla_layers=(0,), token_end=8, mla_row_shape=(4,)), deadline_s=30)
    assert table.admit(_rows_header("r", 0, 0, 4), conn_id=1)[1] is None
    cancelled = threading.Event()
    canceller = threading.Thread(target=lambda: (table.cancel("r"), cancelled.set()))
    canceller.start()
    assert not cancelled.wait(0.3)  # still landing: cancel waits
    table.landed("r")
    canceller.join(10)
    assert cancelled.is_set() and len(table) == 0


# ---- the shm ring and the choice of address -------------------------------------------------


def test_shm_ring_places_fifo_and_wraps():
    ring = ShmRing(100)
    try:

        async def scenario() -> list[int]:
            offsets = [await ring.alloc(1, 40), await ring.alloc(2, 40)]
            assert ring._try_place(30) is None  # 20 left at the end, nothing freed at the start
            ring.release(1)
            offsets.append(await ring.alloc(3, 30))  # wraps to 0, below the tail at 40
            return offsets

        assert asyncio.run(scenario()) == [0, 40, 0]
    finally:
        ring.unlink()


def test_pick_address_prefers_shm_on_the_same_host():
    offered = ["tcp://127.0.0.1:5000", "shm://abc", "ucx://127.0.0.1:6000"]
    assert pick_address("hostA", "hostA", offered) == "shm://abc"
    assert pick_address("hostA", "hostB", offered) == "tcp://127.0.0.1:5000"
    assert pick_address("hostA", "hostB", offered, remote_preference=("ucx", "tcp")).startswith("ucx://")
    with pytest.raises(ValueError, match="no usable address"):
        pick_address("hostA", "hostB", ["shm://abc"])
