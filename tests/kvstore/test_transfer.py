"""Transfer engine tests.

Mechanism tests pin the frame layout, the receiver's bookkeeping, the shm ring and direct
placements (segments, wire form, the fence) at tiny sizes. Contract tests run over every
backend (shm, tcp and ucx: the test install has ucxx, so none is skipped) with the two ends in
different processes (``transfer_peer.py``): byte-exact layerwise delivery, corruption (and the same
request id sent again after an abort, as a retry does), truncation, a killed peer on either
side, backpressure, deadlines and the rejection of unexpected requests. Authentication is in
``test_transfer_auth.py``.
The shm tests at the end pin the one-copy path: a destination in shareable memory is written
directly and verified there, a corrupted direct write leaves no cache, a cancelled request's
memory is not written after ``cancel`` returns, a receiver killed while a sender writes into
its pages fails that sender, and peers of another user are refused (the contract tests check
that shm's corrupted-chunk and killed-sender cases take the direct path too). Child
processes are always killed at teardown, and every receiver must end with no pending request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import numpy as np
import pytest
import torch

from kvstore.transfer import (
    Expected,
    FaultInjection,
    Kind,
    Receiver,
    TransferConfig,
    TransferError,
    connect,
    pick_address,
)
from kvstore.transfer.frames import (
    HEADER_BYTES,
    ChecksumAlgo,
    DType,
    FrameError,
    FrameHeader,
    unpack_header,
)
from kvstore.transfer.placement import FlatPlacement, PagePlacement, Region, RowPlacement
from kvstore.transfer.ring import ShmRing
from kvstore.transfer.stream import RequestTable
from tests.kvstore.transfer_peer import (
    LAYOUT,
    digest,
    make_destination,
    received,
    send_chunks,
    send_states,
    source,
)
from tests.kvstore.transfer_support import BACKENDS

CHUNK_BYTES = LAYOUT.chunk_tokens * LAYOUT.latent_dim * 4


# ---- mechanism: frames, bookkeeping, ring ---------------------------------------------------


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


# ---- contract tests over every backend, across processes ------------------------------------


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def rx(backend):
    receiver = Receiver(TransferConfig(deadline_s=20.0), backends=backend)
    yield receiver
    receiver.check_integrity()
    assert receiver.num_pending == 0, "a test left a request pending in the receiver"
    receiver.close()


def _send_args(rx: Receiver, rid: str, *extra: str) -> list[str]:
    return ["send", "--address", rx.address, "--rid", rid, *extra]


def test_layerwise_transfer_lands_byte_exact(rx, spawn):
    sink, expected = make_destination()
    rx.expect("req-1", sink, expected)
    peer = spawn(*_send_args(rx, "req-1", "--seed", "1"))
    rx.wait_layer("req-1", LAYOUT.mla_layers[0])
    rx.wait_layer("req-1", LAYOUT.kda_layers[0])
    result = rx.wait_complete("req-1")
    assert peer.event("done")["error"] is None
    assert digest(received(sink)) == digest(source(1))
    assert result.num_frames == len(LAYOUT.chunks) * len(LAYOUT.mla_layers) + 2 * len(LAYOUT.kda_layers)
    unused_pages = sorted(set(range(sink.pool.shape[1])) - set(sink.page_table.tolist()))
    assert torch.isnan(sink.pool[:, unused_pages]).all(), "rows landed outside the request's pages"


def test_corrupted_chunk_fails_with_checksum_mismatch(rx, spawn, backend):
    sink, expected = make_destination()
    rx.expect("req-c", sink, expected)
    peer = spawn(*_send_args(rx, "req-c", "--corrupt-seq", "2"))
    with pytest.raises(TransferError, match="checksum mismatch in MLA_ROWS request 'req-c' seq 2"):
        rx.wait_complete("req-c")
    assert "checksum mismatch" in peer.event("done")["error"]
    assert (rx.frames_direct > 0) == (backend == "shm")  # shm: the one-copy path, verified in place


def test_a_failed_request_id_can_be_sent_again_after_abort(rx):
    """What a Conductor retry does: the first attempt fails (a corrupted frame), the sender
    aborts it and waits for the receiver, which expects the same id again on the same
    connection; nothing of the first attempt reaches the second, which lands byte-exact."""
    sink, expected = make_destination()
    rx.expect("retry", sink, expected)
    data = source(13)
    tx = connect(rx.address, TransferConfig(deadline_s=20.0), faults=FaultInjection(corrupt_seq=2))
    try:
        with pytest.raises(TransferError, match="checksum mismatch in MLA_ROWS request 'retry' seq 2"):
            send_chunks(tx, "retry", data, LAYOUT.chunks)
            send_states(tx, "retry", data)
            tx.finish("retry", LAYOUT.num_units)
        tx.abort("retry", "attempt 1 failed", wait_s=10.0)  # no raise: the request had failed
        with pytest.raises(TransferError, match="checksum mismatch"):
            rx.wait_complete("retry")
        sink2, expected2 = make_destination()
        rx.expect("retry", sink2, expected2)
        send_chunks(tx, "retry", data, LAYOUT.chunks)
        send_states(tx, "retry", data)
        tx.finish("retry", LAYOUT.num_units)
        assert tx.sync(10.0) and not tx.failed
    finally:
        tx.close()
    rx.wait_complete("retry")
    assert digest(received(sink2)) == digest(data)


def test_truncated_frame_fails_clearly(rx, spawn):
    sink, expected = make_destination()
    rx.expect("req-t", sink, expected)
    peer = spawn(*_send_args(rx, "req-t", "--truncate-seq", "3"))
    with pytest.raises(TransferError, match="truncated frame: connection closed after"):
        rx.wait_complete("req-t")
    assert "truncated" in peer.event("done")["error"]


def test_killed_sender_fails_request_and_receiver_keeps_serving(rx, spawn, backend):
    sink, expected = make_destination()
    rx.expect("req-k", sink, expected)
    peer = spawn(*_send_args(rx, "req-k", "--scenario", "hold"))
    peer.event("ready")
    if backend == "shm":  # killed while writing into our pages (counted once the receiver reads the header)
        until = time.monotonic() + 10
        while rx.frames_direct == 0 and time.monotonic() < until:
            time.sleep(0.01)
    assert (rx.frames_direct > 0) == (backend == "shm")
    peer.kill()
    with pytest.raises(TransferError, match="peer connection lost"):
        rx.wait_complete("req-k")
    sink2, expected2 = make_destination()
    rx.expect("req-after", sink2, expected2)
    follow_up = spawn(*_send_args(rx, "req-after", "--seed", "2"))
    rx.wait_complete("req-after")
    assert follow_up.event("done")["error"] is None
    assert digest(received(sink2)) == digest(source(2))


def test_deadline_fails_the_waiting_receiver_and_tells_the_sender(rx, spawn):
    sink, expected = make_destination()
    rx.expect("req-never", sink, expected, deadline_s=0.2)
    with pytest.raises(TransferError, match="missed its deadline"):
        rx.wait_complete("req-never")
    rx.expect("req-late", *make_destination(), deadline_s=1.0)
    peer = spawn(*_send_args(rx, "req-late", "--scenario", "hold"))
    peer.event("ready")
    with pytest.raises(TransferError, match="missed its deadline of 1 s; missing: layer 3 has tokens"):
        rx.wait_complete("req-late")
    peer.tell("go")
    assert peer.event("done")["error"] is not None


def test_unexpected_request_is_rejected_back_to_the_sender(rx, spawn):
    peer = spawn(*_send_args(rx, "stranger"))
    assert "'stranger' is not expected by this receiver" in peer.event("done")["error"]


def test_backpressure_bounds_inflight_bytes(backend, spawn):
    receiver = spawn("receive", "--backend", backend, "--rids", "req-bp", "--sink-delay-s", "0.003")
    address = receiver.event("listening")["address"]
    bound_bytes = 2 * CHUNK_BYTES
    tx = connect(address, TransferConfig(deadline_s=20.0, max_inflight_bytes=bound_bytes, max_frame_bytes=CHUNK_BYTES))
    try:
        data = source(3)
        send_chunks(tx, "req-bp", data, LAYOUT.chunks)
        send_states(tx, "req-bp", data)
        tx.finish("req-bp", LAYOUT.num_units)
        stats = tx.stats()
    finally:
        tx.close()
    assert 0 < stats.inflight_high_water_bytes <= bound_bytes
    assert stats.num_backpressure_waits > 0, "the slow sink never made the sender wait"
    result = receiver.event("result")
    assert result["error"] is None and result["digest"] == digest(source(3))


def test_killed_receiver_fails_the_sender(backend, spawn):
    receiver = spawn("receive", "--backend", backend, "--rids", "req-rk", "--sink-delay-s", "0.05")
    address = receiver.event("listening")["address"]
    tx = connect(
        address,
        TransferConfig(deadline_s=10.0, max_inflight_bytes=4 * CHUNK_BYTES, max_frame_bytes=CHUNK_BYTES),
    )
    try:
        data = source(4)
        send_chunks(tx, "req-rk", data, LAYOUT.chunks[:1])
        receiver.kill()
        with pytest.raises(TransferError, match="connection|lost|closed"):
            send_chunks(tx, "req-rk", data, LAYOUT.chunks[1:])
            send_states(tx, "req-rk", data)
            tx.finish("req-rk", LAYOUT.num_units)
    finally:
        tx.close()


def test_blob_transfer_round_trips(rx):
    from kvstore.transfer import BlobSink

    blobs = [
        np.random.default_rng(i).integers(0, 256, size=n, dtype=np.uint8).tobytes()
        for i, n in enumerate((100_000, 1 << 20))
    ]
    sink = BlobSink()
    rx.expect("pull", sink, Expected(num_blobs=len(blobs)))
    tx = connect(rx.address, TransferConfig(max_frame_bytes=2 << 20, max_inflight_bytes=4 << 20))
    try:
        for index, blob in enumerate(blobs):
            tx.send("pull", index, Kind.BLOB, (0, 0), blob)
        tx.finish("pull", len(blobs))
    finally:
        tx.close()
    rx.wait_complete("pull")
    assert [sink.blobs[i] for i in range(len(blobs))] == blobs


def test_bf16_rows_land_and_a_rejecting_sink_fails_the_request(rx):
    from kvstore.transfer import PagePoolSink

    rows = torch.randn(8, 16).to(torch.bfloat16)
    pool = torch.zeros(1, 2, 4, 16, dtype=torch.bfloat16)
    sink = PagePoolSink(pool, torch.tensor([1, 0]), {5: 0})
    expected = Expected(mla_layers=(5,), token_start=0, token_end=8, mla_row_shape=(16,), mla_dtype=torch.bfloat16)
    rx.expect("bf16", sink, expected)
    rx.expect("refused", PagePoolSink(pool.clone(), torch.tensor([0, 1]), {}), expected)
    tx = connect(rx.address)
    try:
        tx.send("bf16", 5, Kind.MLA_ROWS, (0, 8), rows)
        tx.finish("bf16", 1)
        tx.send("refused", 5, Kind.MLA_ROWS, (0, 8), rows)
        with pytest.raises(TransferError, match="destination rejected .* no pool slot for MLA layer 5"):
            tx.finish("refused", 1)
    finally:
        tx.close()
    rx.wait_complete("bf16")
    assert torch.equal(sink.gather_rows(5, 0, 8), rows)
    with pytest.raises(TransferError, match="no pool slot"):
        rx.wait_complete("refused")


def test_abort_and_cancel_reach_the_other_side(rx):
    sink, expected = make_destination()
    rx.expect("aborted", sink, expected)
    rx.expect("cancelled", *make_destination())
    data = source(5)
    tx = connect(rx.address)
    try:
        send_chunks(tx, "aborted", data, LAYOUT.chunks[:1])
        tx.abort("aborted", "prefill ran out of memory")
        with pytest.raises(TransferError, match="aborted by the sender: prefill ran out of memory"):
            rx.wait_complete("aborted")
        send_chunks(tx, "cancelled", data, LAYOUT.chunks[:1])
        tx.flush()
        rx.cancel("cancelled")
        with pytest.raises(TransferError, match="cancelled by the receiver"):
            tx.finish("cancelled", LAYOUT.num_units)
        assert not tx.failed, "a failed request must not fail the connection"
    finally:
        tx.close()


# ---- shm direct placement: one copy into the receiver's memory, verified there --------------


def test_row_placement_segments_merge_adjacent_pages_and_stay_inside():
    rows = RowPlacement(region=0, layer_offsets=((3, 1000),), page_ids=(4, 5, 9, 2), rows_per_page=4,
                        row_bytes=8, page_stride=32)
    # tokens [2, 11): page 4 rows 2-3, page 5 rows 0-3 (adjacent: merged), page 9 rows 0-2
    assert rows.segments(3, 2, 11) == [(0, 1000 + 4 * 32 + 16, 16 + 32), (0, 1000 + 9 * 32, 24)]
    assert rows.segments(3, 0, 17) is None  # beyond the 4 pages
    assert rows.segments(7, 0, 4) is None  # not a placed layer
    many = RowPlacement(0, ((0, 0),), tuple(range(40, 0, -1)), 2, 4, 8)  # numpy path, nothing adjacent
    assert many.segments(0, 1, 79) == [(0, 40 * 8 + 4, 4)] + [(0, p * 8, 8) for p in range(39, 1, -1)] + [(0, 8, 4)]


def test_placement_round_trips_and_a_sender_refuses_one_beyond_its_region():
    rows = RowPlacement(0, ((3, 0), (7, 4096)), (1, 0, 2), 16, 256, 4096)
    placement = PagePlacement(
        (Region(fd=5, inode=77, nbytes=3 * 4096 * 2), Region(6, 78, 1024)),
        rows,
        (FlatPlacement(Kind.KDA_STATE, 0, 1, 0, 512), FlatPlacement(Kind.KDA_CONV, 0, 1, 512, 512)),
    )
    assert PagePlacement.unpack(placement.pack()) == placement
    assert placement.segments(Kind.KDA_CONV, 0, 0, 96) == [(1, 512, 512)]
    too_far = PagePlacement((Region(5, 77, 4096),), rows)
    with pytest.raises(FrameError, match="beyond their region"):
        PagePlacement.unpack(too_far.pack())
    with pytest.raises(FrameError, match="malformed placement"):
        PagePlacement.unpack(placement.pack()[:-3])


def test_a_failed_placed_request_is_forgotten_only_once_its_sender_is_fenced():
    table = RequestTable(fence_timeout_s=5.0)
    expected = Expected(mla_layers=(0,), token_end=8, mla_row_shape=(4,))
    table.add("r", sink=None, expected=expected, deadline_s=30)
    table.open("r", conn_id=1)  # binds the request to connection 1
    assert table.placed("r", 1, placement=None)
    table.fail("r", "checksum mismatch")
    fenced_at: list[float] = []

    def fence_later() -> None:
        time.sleep(0.2)
        fenced_at.append(time.monotonic())
        table.fence("r", conn_id=1)

    threading.Thread(target=fence_later).start()
    with pytest.raises(TransferError, match="checksum mismatch"):
        table.wait_complete("r", timeout_s=0)
    assert fenced_at and time.monotonic() >= fenced_at[0], "wait_complete returned before the fence"
    assert len(table) == 0
    impatient = RequestTable(fence_timeout_s=0.1)  # a sender that never answers: bounded wait
    impatient.add("s", sink=None, expected=expected, deadline_s=30)
    impatient.open("s", 2)
    impatient.placed("s", 2, placement=None)
    started = time.monotonic()
    impatient.cancel("s")
    assert 0.1 <= time.monotonic() - started < 2.0 and len(impatient) == 0


def _shm_rx() -> Receiver:
    return Receiver(TransferConfig(deadline_s=20.0), backends="shm")


@pytest.mark.parametrize("shared", [True, False], ids=["direct", "ring"])
def test_shm_writes_shared_destinations_directly_and_private_ones_through_the_ring(shared):
    rx = _shm_rx()
    try:
        sink, expected = make_destination(shared=shared)
        rx.expect("req-d", sink, expected)
        tx = connect(rx.address)
        try:
            data = source(6)
            send_chunks(tx, "req-d", data, LAYOUT.chunks)
            send_states(tx, "req-d", data)
            tx.finish("req-d", LAYOUT.num_units)
        finally:
            tx.close()
        result = rx.wait_complete("req-d")
        assert digest(received(sink)) == digest(data)
        assert rx.frames_direct == (result.num_frames if shared else 0)
        unused_pages = sorted(set(range(sink.pool.shape[1])) - set(sink.page_table.tolist()))
        assert torch.isnan(sink.pool[:, unused_pages]).all(), "a direct write landed outside the request's pages"
    finally:
        rx.check_integrity()
        rx.close()


def _send_alone(tx, rid: str, data) -> None:
    """Every row chunk written with nothing queued behind it (as a prefill's layers go out)."""
    for t0, t1 in LAYOUT.chunks:
        for layer in sorted(LAYOUT.mla_layers):
            tx.send(rid, layer, Kind.MLA_ROWS, (t0, t1), data["mla", layer][t0:t1])
            tx.flush()
    send_states(tx, rid, data)


def test_a_large_direct_chunk_is_written_and_verified_a_piece_at_a_time(monkeypatch):
    """A row chunk over ``DIRECT_PIECE_BYTES`` with nothing queued behind it reaches the
    receiver as several direct pieces, each verified on its own (pieces of 12 rows here: across
    the scrambled pages, none page-aligned); one queued behind another goes whole; a damaged
    piece fails the request naming its rows."""
    from kvstore.transfer import direct

    monkeypatch.setattr(direct, "DIRECT_PIECE_BYTES", 12 * LAYOUT.latent_dim * 4)
    rx = _shm_rx()
    try:
        sink, expected = make_destination()
        data = source(11)
        row_chunks = len(LAYOUT.chunks) * len(LAYOUT.mla_layers)
        for rid, alone in (("req-p", True), ("req-q", False)):
            rx.expect(rid, sink, expected)
            tx = connect(rx.address)
            try:
                if alone:
                    _send_alone(tx, rid, data)
                else:  # all queued at once: a data frame is behind every row chunk
                    send_chunks(tx, rid, data, LAYOUT.chunks)
                    send_states(tx, rid, data)
                tx.finish(rid, LAYOUT.num_units)
                frames_sent = tx.stats().frames_sent
            finally:
                tx.close()
            result = rx.wait_complete(rid)
            assert digest(received(sink)) == digest(data)
            # 3 pieces per 32-row chunk: 2 more frames each for the receiver than the sender wrote
            assert result.num_frames == frames_sent + 2 * (row_chunks if alone else 0)
        rx.expect("req-bad", sink, expected)
        tx = connect(rx.address, faults=FaultInjection(corrupt_seq=1))  # rows [0, 32) of the first layer
        try:
            with pytest.raises(TransferError, match="checksum mismatch"):
                _send_alone(tx, "req-bad", data)
                tx.finish("req-bad", LAYOUT.num_units)
        finally:
            tx.close()
        pattern = r"checksum mismatch in MLA_ROWS request 'req-bad' seq 1 layer 3 tokens \[12, 24\).*directly"
        with pytest.raises(TransferError, match=pattern):
            rx.wait_complete("req-bad")
    finally:
        rx.check_integrity()
        rx.close()


def test_corrupted_direct_write_fails_the_request_and_the_pages_serve_the_next_one(spawn):
    rx = _shm_rx()
    try:
        sink, expected = make_destination()
        rx.expect("req-bad", sink, expected)
        peer = spawn(*_send_args(rx, "req-bad", "--corrupt-seq", "4"))
        with pytest.raises(TransferError, match="checksum mismatch in MLA_ROWS request 'req-bad' seq 4.*directly"):
            rx.wait_complete("req-bad")
        assert "checksum mismatch" in peer.event("done")["error"]
        assert rx.frames_direct > 0 and rx.num_pending == 0  # nothing of it is visible as a cache
        # The decode worker frees and reuses those pages: the next request lands byte-exact.
        rx.expect("req-next", sink, expected)
        follow_up = spawn(*_send_args(rx, "req-next", "--seed", "8"))
        rx.wait_complete("req-next")
        assert follow_up.event("done")["error"] is None
        assert digest(received(sink)) == digest(source(8))
    finally:
        rx.check_integrity()
        rx.close()


def test_cancel_returns_only_when_the_sender_writes_nothing_more(spawn):
    rx = _shm_rx()
    try:
        sink, expected = make_destination()
        rx.expect("req-cx", sink, expected)
        peer = spawn(*_send_args(rx, "req-cx", "--scenario", "hold"))
        peer.event("ready")
        assert rx.frames_direct > 0
        rx.cancel("req-cx")  # waits for the sender's REVOKED
        sink.pool.fill_(-7.0)  # the pages go to someone else now
        for table in (sink.kda_state, sink.kda_conv):
            for tensor in table.values():
                tensor.fill_(-7.0)
        peer.tell("go")
        assert "cancelled by the receiver" in peer.event("done")["error"]
        assert (sink.pool == -7.0).all() and all((t == -7.0).all() for t in sink.kda_state.values())
    finally:
        rx.check_integrity()
        rx.close()


def test_killed_receiver_fails_a_sender_writing_into_its_pages(spawn):
    """The receiver dies after the sender wrote chunks straight into its pool: whatever the
    sender still writes lands in memory it maps (no crash), and its verdict is a TransferError."""
    receiver = spawn("receive", "--backend", "shm", "--rids", "req-rd", "--announce-layer", str(LAYOUT.mla_layers[0]))
    tx = connect(receiver.event("listening")["address"], TransferConfig(deadline_s=10.0))
    try:
        data = source(5)
        send_chunks(tx, "req-rd", data, LAYOUT.chunks)
        assert receiver.event("layer")["frames_direct"] > 0
        receiver.kill()
        with pytest.raises(TransferError, match="connection|lost|closed"):
            send_states(tx, "req-rd", data)
            tx.finish("req-rd", LAYOUT.num_units)
    finally:
        tx.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to start a peer of another user")
def test_shm_refuses_a_peer_of_another_user(spawn, caplog):
    # The intruder (uid 65534) imports everything it runs before it drops to that uid
    # (transfer_peer.become): it reads nothing of the checkout, which that user may not read.
    rx = _shm_rx()
    try:
        with caplog.at_level(logging.WARNING):
            peer = spawn(*_send_args(rx, "intruder", "--as-uid", "65534"))
            assert "connect failed: shm handshake failed" in peer.event("done")["error"]
        assert "shm peer runs as uid 65534" in caplog.text and "refused" in caplog.text
    finally:
        rx.close()


def test_contiguous_row_chunks_are_coalesced_into_fewer_frames(rx):
    sink, expected = make_destination()
    rx.expect("req-co", sink, expected)
    data = source(9)
    tx = connect(rx.address, TransferConfig(max_frame_bytes=1 << 20, max_inflight_bytes=8 << 20))
    try:
        for layer in LAYOUT.mla_layers:  # one layer at a time: 96 one-token chunks each
            for t in range(LAYOUT.num_tokens):
                tx.send("req-co", layer, Kind.MLA_ROWS, (t, t + 1), data["mla", layer][t : t + 1])
        send_states(tx, "req-co", data)
        tx.finish("req-co", LAYOUT.num_units)
        frames_sent = tx.stats().frames_sent
    finally:
        tx.close()
    result = rx.wait_complete("req-co")
    assert digest(received(sink)) == digest(data)
    rows_sent = len(LAYOUT.mla_layers) * LAYOUT.num_tokens
    assert result.num_frames == frames_sent < rows_sent + 2 * len(LAYOUT.kda_layers)


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
