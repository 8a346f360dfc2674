"""The shm backend's one-copy path: a destination in shareable memory is written directly by
the sender and verified there. At tiny sizes: row placements merge adjacent pages into
segments and stay inside them, a placement round-trips its wire form and one beyond its
region is refused, and a failed placed request is forgotten only once its sender is fenced
(or a bounded wait has passed). Across processes: a shared destination is written directly
and a private one through the ring, byte-exact either way; a large chunk is written and
verified a piece at a time; a corrupted direct write leaves no cache and the pages serve the
next request; a cancelled request's memory is not written after ``cancel`` returns; a
receiver killed while a sender writes into its pages fails that sender; and peers of another
user are refused. (``test_transfer_contract.py`` checks that shm's corrupted-chunk and
killed-sender cases take the direct path too.) Child processes are always killed at teardown.
"""

from __future__ import annotations

import logging
import os
import threading
import time

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
)
from kvstore.transfer.frames import FrameError
from kvstore.transfer.placement import FlatPlacement, PagePlacement, Region, RowPlacement
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
from tests.kvstore.transfer_support import send_args as _send_args

# ---- mechanism: placements and the fence, at tiny sizes -------------------------------------


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


# ---- across processes: one copy into the receiver's memory, verified there ------------------


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
