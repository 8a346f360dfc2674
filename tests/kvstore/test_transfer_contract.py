"""The contract every transfer backend keeps (shm, tcp and ucx: the test install has ucxx, so
none is skipped), with the two ends in different processes (``transfer_peer.py``).

- Data path: layerwise delivery lands byte-exact in the request's pages and nowhere else;
  blobs and bf16 rows round-trip; contiguous one-token row chunks are coalesced into fewer
  frames.
- Flow control: a slow sink makes the sender wait, and in-flight bytes stay within the bound.
- Failures: a corrupted chunk fails with a checksum mismatch (on shm through the direct
  path), and the same request id can be sent again after an abort, as a retry does; a
  truncated frame, a killed sender (the receiver keeps serving) or a killed receiver, a missed
  deadline, an unexpected request, a sink that rejects a frame, an abort and a cancel each
  fail the request on both sides with a reason that names it.

Child processes are always killed at teardown, and every receiver must end with no pending
request. The shm one-copy path is in ``test_transfer_shm.py``, ucx's own mechanics in
``test_transfer_ucx.py``, authentication in ``test_transfer_auth.py``.
"""

from __future__ import annotations

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
)
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
from tests.kvstore.transfer_support import send_args as _send_args

CHUNK_BYTES = LAYOUT.chunk_tokens * LAYOUT.latent_dim * 4


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


# ---- data path: byte-exact delivery of rows, states and blobs -------------------------------


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


# ---- flow control ---------------------------------------------------------------------------


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


# ---- failures: bad frames, lost peers, deadlines, aborts ------------------------------------


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
