"""The ucx backend's own mechanics (its contract tests run with every backend in
``test_transfer_contract.py`` and ``test_transfer_auth.py``): ucxx is installed by the test install and
works here without a GPU (UCX over tcp on loopback); abandoned UCX operations are collected
(every exception retrieved) and logged once per link, in one line, when it closes; a killed
peer leaves no exception unretrieved; ``shutdown_ucx`` stops ucxx's notifier thread, even when
``UCXPY_PROGRESS_MODE`` asks for a mode without one (it is overridden). A body
whose destination is one contiguous view is received straight into it and checksummed there
(a fake endpoint stands for UCX); a scattered destination goes through a staging buffer; a
receive into the destination that never completes aborts the endpoint before it fails. The
transfer bench's UCX ceiling runs its two processes to their end. The receiver reads the next
header while a body lands: a body the sender holds back does not keep the frames behind it
from landing, and a chunk admitted meanwhile cannot take the place of one still landing.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvstore.transfer import Expected, Receiver, TransferConfig, TransferError, connect, ucx_unavailable_reason
from kvstore.transfer.base import Address, Frame
from kvstore.transfer.frames import ChecksumAlgo, DType, FrameHeader, Kind, checksum, control_header
from kvstore.transfer.ioloop import IoThread
from kvstore.transfer.orphans import Orphans, num_parked
from kvstore.transfer.registry import get_backend
from kvstore.transfer.sinks import BlobSink
from kvstore.transfer.ucx import UcxRecvLink, _tag
from tests.kvstore.transfer_peer import LAYOUT, send_chunks, send_states, source
from tests.kvstore.transfer_support import REPO_ROOT

CHUNK_BYTES = LAYOUT.chunk_tokens * LAYOUT.latent_dim * 4


def test_ucx_is_installed_and_imports():
    assert ucx_unavailable_reason() is None, "install the test extras with `bash scripts/dev.sh test` (ucx extra)"


def test_abandoned_operations_are_collected_and_logged_once_per_link(caplog):
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        link = Orphans("ucx link under test")
        ops = [loop.create_future() for _ in range(3)]
        link.park(ops)
        assert num_parked() >= 3
        ops[0].set_exception(ConnectionResetError("reset"))
        ops[1].set_exception(ConnectionResetError("reset"))
        link.seal()  # one still pending: nothing logged yet
        assert "abandoned" not in caplog.text
        ops[2].set_result(None)
        await asyncio.sleep(0)  # done callbacks run on the next loop turn

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
        gc.collect()
    lines = [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]
    assert lines == ["ucx link under test: 3 abandoned UCX operation(s) ended: 1 completed, "
                     "2 failed with ConnectionResetError('reset')"]
    assert "never retrieved" not in caplog.text


def test_killed_receiver_leaves_no_exception_unretrieved(spawn, caplog):
    before = num_parked()  # what earlier tests of this process left parked
    receiver = spawn("receive", "--backend", "ucx", "--rids", "req-o", "--sink-delay-s", "0.2")
    tx = connect(receiver.event("listening")["address"],
                 TransferConfig(deadline_s=10.0, max_inflight_bytes=8 * CHUNK_BYTES, max_frame_bytes=CHUNK_BYTES))
    with caplog.at_level(logging.INFO):
        try:
            data = source(4)
            send_chunks(tx, "req-o", data, LAYOUT.chunks[:2])  # bodies in flight, the sink slow
            receiver.kill()
            with pytest.raises(TransferError, match="connection|lost|closed"):
                send_chunks(tx, "req-o", data, LAYOUT.chunks[2:])
                send_states(tx, "req-o", data)
                tx.finish("req-o", LAYOUT.num_units)
        finally:
            tx.close()
        until = time.monotonic() + 20
        while num_parked() > before and time.monotonic() < until:
            time.sleep(0.05)
        gc.collect()
        time.sleep(0.1)  # the I/O loop reports a never-retrieved exception when it drops the task
    assert num_parked() <= before, f"{num_parked() - before} abandoned UCX operations never ended"
    assert "never retrieved" not in caplog.text, caplog.text


def test_shutdown_stops_the_notifier_thread_and_the_process_exits_cleanly():
    code = (
        "import threading\n"
        "from kvstore.transfer import Receiver, TransferConfig\n"
        "from kvstore.transfer.ucx import shutdown_ucx\n"
        "rx = Receiver(TransferConfig(), backends='ucx')\n"
        "names = lambda: [t.name for t in threading.enumerate() if 'Notifier' in t.name]\n"
        "assert names(), 'no notifier thread was started'\n"
        "rx.close()\n"
        "shutdown_ucx()\n"
        "shutdown_ucx()  # idempotent\n"
        "print('notifier threads after shutdown:', names())\n"
    )
    # A progress mode that would turn ucxx's Python futures off (and with them the notifier
    # thread) is overridden, not obeyed: the backend's completions need them.
    env = {**os.environ, "UCXPY_PROGRESS_MODE": "blocking"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "notifier threads after shutdown: []" in done.stdout, done.stdout
    assert "UCXPY_PROGRESS_MODE=blocking ignored" in done.stderr, done.stderr[-2000:]


BODY = np.random.default_rng(5).integers(0, 256, size=3000, dtype=np.uint8)


class FakeConn:
    """The control connection as ``UcxRecvLink`` and ``_race_close`` see it."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.closed_reason = ""
        self.released = 0

    def release(self) -> None:
        self.released += 1


class FakeEndpoint:
    """A UCX endpoint whose tag receive writes ``message`` into the buffer it is given (or,
    with ``hang``, never completes); it records those buffers."""

    def __init__(self, message: np.ndarray, hang: bool = False) -> None:
        self.message, self.hang = message, hang
        self.buffers: list[tuple[np.ndarray, int]] = []
        self.closed = False

    async def recv(self, buffer: np.ndarray, tag: int, force_tag: bool) -> None:
        assert force_tag
        self.buffers.append((buffer, tag))
        if self.hang:
            await asyncio.Event().wait()
        np.copyto(buffer, self.message)

    def abort(self) -> None:
        self.closed = True


def body_frame(seq: int = 7) -> Frame:
    header = FrameHeader(Kind.BLOB, "r", seq=seq, dtype=DType.UINT8, shape=(BODY.nbytes,), body_bytes=BODY.nbytes,
                         body_checksum=checksum(ChecksumAlgo.CRC32, BODY), checksum_algo=ChecksumAlgo.CRC32)
    return Frame(header, None)


def read(endpoint: FakeEndpoint, targets: list[np.ndarray], deadline_s: float = 10.0):
    async def scenario():
        link = UcxRecvLink(FakeConn(), endpoint, 3, TransferConfig(deadline_s=deadline_s))
        try:
            return await link.read_data(body_frame(), targets)
        finally:
            link.release(body_frame())

    return asyncio.run(scenario())


def test_a_contiguous_destination_receives_the_body_itself_and_is_checksummed_there():
    destination = np.zeros(BODY.nbytes, np.uint8)
    endpoint = FakeEndpoint(BODY)
    staged, actual, expected = read(endpoint, [destination])
    [(buffer, tag)] = endpoint.buffers
    assert np.shares_memory(buffer, destination), "the body went through a staging buffer"
    assert tag == _tag(3, 7)
    assert staged.nbytes == 0 and np.array_equal(destination, BODY)
    assert actual == expected == checksum(ChecksumAlgo.CRC32, BODY)


def test_a_damaged_body_received_in_place_shows_as_a_checksum_that_differs():
    damaged = BODY.copy()
    damaged[1500] ^= 1
    _, actual, expected = read(FakeEndpoint(damaged), [np.zeros(BODY.nbytes, np.uint8)])
    assert expected == checksum(ChecksumAlgo.CRC32, BODY) and actual != expected


def test_a_scattered_destination_is_filled_from_a_staging_buffer():
    targets = [np.zeros(1000, np.uint8), np.zeros(BODY.nbytes - 1000, np.uint8)]
    endpoint = FakeEndpoint(BODY)
    _, actual, expected = read(endpoint, targets)
    [(buffer, _)] = endpoint.buffers
    assert not any(np.shares_memory(buffer, t) for t in targets)
    assert np.array_equal(np.concatenate(targets), BODY) and actual == expected


def test_a_receive_into_the_destination_that_never_completes_aborts_the_endpoint_first():
    endpoint = FakeEndpoint(BODY, hang=True)
    with pytest.raises(ConnectionError, match="did not complete"):
        read(endpoint, [np.zeros(BODY.nbytes, np.uint8)], deadline_s=0.05)
    assert endpoint.closed, "UCX could still write into the destination after the failure"


def test_the_bench_ucx_ceiling_measures_both_receive_patterns_and_its_children_end(monkeypatch):
    """``bench.transfer``'s UCX ceiling: two real processes with the backend's UCX, every size
    measured with receives posted ahead and one at a time, and both children ending by
    themselves (a child left inside ucxx at exit would be killed: exit code not 0)."""
    from bench import transfer_peers

    monkeypatch.setattr(transfer_peers, "CHILD_TIMEOUT_S", 30.0)  # a bound on a hang, not a speed
    ahead, one = transfer_peers.bench_ucx_ceiling(repeats=1, total_bytes=2 << 20, inflight_bytes=4 << 20)
    assert ahead["exit_codes"] == [0, 0], ahead
    for name in transfer_peers.MOONCAKE_SIZES:
        assert ahead[name]["median_gbps"] > 0 and one[name]["median_gbps"] > 0, (ahead, one)


# ---- the receiver reads the next header while a body lands (``kvstore.transfer.landing``) ----


def blob_header(seq: int, index: int, body: np.ndarray) -> FrameHeader:
    """A blob's data header as the ucx sender writes it (its body goes as a tag message)."""
    return FrameHeader(Kind.BLOB, "r", seq=seq, layer=index, dtype=DType.UINT8, shape=(body.nbytes,),
                       body_bytes=body.nbytes, body_checksum=checksum(ChecksumAlgo.CRC32, body),
                       checksum_algo=ChecksumAlgo.CRC32)


class RawUcxSender:
    """A ucx link to an in-process receiver, driven frame by frame: a header can go without
    its body, which is sent later (``release_body``), as a slow or reordering sender would."""

    def __init__(self, receiver: Receiver, config: TransferConfig):
        self.io = IoThread.shared()
        self.link = self.io.run(get_backend("ucx").connect(Address.parse(receiver.address), config), 10)

    def header_only(self, header: FrameHeader) -> None:
        self.io.run(self.link.conn.write(header.pack()), 10)

    def release_body(self, header: FrameHeader, body: np.ndarray) -> None:
        send = self.link._endpoint.send(body, tag=_tag(self.link._tag_prefix, header.seq), force_tag=True)
        self.io.run(_awaited(send), 10)

    def frame(self, header: FrameHeader, body: np.ndarray) -> None:
        self.io.run(self.link.send_data(header, [memoryview(body)]), 10)

    def end(self, num_units: int) -> None:
        self.header_only(control_header(Kind.END, "r", layer=num_units))

    def close(self) -> None:
        self.io.run(_closed(self.link), 10)


async def _awaited(operation) -> None:
    await operation


async def _closed(link) -> None:
    link.close()


BLOBS = [np.random.default_rng(seed).integers(0, 256, size=64 << 10, dtype=np.uint8) for seed in (1, 2)]
TWO_BLOBS = Expected(num_blobs=2, max_blob_bytes=1 << 20)


@contextlib.contextmanager
def blob_request(deadline_s: float = 20.0, request_deadline_s: float | None = None):
    """An in-process ucx receiver expecting request "r" (two blobs into a ``BlobSink``) and a
    ``RawUcxSender`` linked to it; both closed at the end."""
    config = TransferConfig(deadline_s=deadline_s)
    receiver = Receiver(config, backends="ucx")
    sink = BlobSink()
    receiver.expect("r", sink, TWO_BLOBS, deadline_s=request_deadline_s)
    sender = RawUcxSender(receiver, config)
    try:
        yield receiver, sink, sender
    finally:
        sender.close()
        receiver.close()


def test_a_body_held_back_does_not_keep_the_frames_behind_it_from_landing():
    """Blob 0's header arrives, its body does not (yet); blob 1, behind it, lands and is
    counted anyway: the receiver posted blob 0's receive and read on. Once blob 0's body
    comes, the request completes with both exact."""
    with blob_request() as (receiver, sink, sender):
        held, behind = blob_header(1, 0, BLOBS[0]), blob_header(2, 1, BLOBS[1])
        sender.header_only(held)
        sender.frame(behind, BLOBS[1])
        receiver.wait_layer("r", 1, timeout_s=10)  # a receiver that waited for blob 0 times out here
        assert 0 not in sink.blobs and sink.blobs[1] == BLOBS[1].tobytes()
        sender.release_body(held, BLOBS[0])
        sender.end(2)
        result = receiver.wait_complete("r", timeout_s=10)
        assert result.num_frames == 2
        assert sink.blobs == {0: BLOBS[0].tobytes(), 1: BLOBS[1].tobytes()}


def test_a_chunk_admitted_while_another_lands_cannot_take_its_place():
    """Blob 0's header is admitted and its body still landing when a second blob 0 comes:
    the second is refused as a duplicate (the first claimed its place on admission), and the
    request fails rather than completing with whichever body landed last."""
    with blob_request() as (receiver, _, sender):
        held = blob_header(1, 0, BLOBS[0])
        sender.header_only(held)
        sender.frame(blob_header(2, 0, BLOBS[1]), BLOBS[1])
        sender.release_body(held, BLOBS[0])
        sender.end(2)
        with pytest.raises(TransferError, match="duplicate blob 0"):
            receiver.wait_complete("r", timeout_s=10)


def test_a_body_that_never_comes_fails_its_request_and_the_receiver_serves_the_next_link():
    """Blob 0's body never comes; blob 1 lands behind it. The request fails at its deadline
    naming what is missing (blob 0 only), nothing hangs, and a new link to the same receiver
    completes a request under the same id (a retry)."""
    with blob_request(deadline_s=5.0, request_deadline_s=1.0) as (receiver, _, sender):
        sender.header_only(blob_header(1, 0, BLOBS[0]))
        sender.frame(blob_header(2, 1, BLOBS[1]), BLOBS[1])
        started = time.monotonic()
        with pytest.raises(TransferError, match="missed its deadline") as failed:
            receiver.wait_complete("r", timeout_s=15)
        assert time.monotonic() - started < 10
        assert "blob 0 missing" in str(failed.value) and "blob 1" not in str(failed.value)
        sender.close()  # blob 0's receive fails, maybe once the retry is expected: it must not fail that
        again = RawUcxSender(receiver, TransferConfig(deadline_s=5.0))
        try:
            sink = BlobSink()
            receiver.expect("r", sink, TWO_BLOBS)
            again.frame(blob_header(1, 0, BLOBS[0]), BLOBS[0])
            again.frame(blob_header(2, 1, BLOBS[1]), BLOBS[1])
            again.end(2)
            receiver.wait_complete("r", timeout_s=10)
            assert sink.blobs == {0: BLOBS[0].tobytes(), 1: BLOBS[1].tobytes()}
        finally:
            again.close()


def test_the_bench_compares_ucx_and_tcp_per_cpu_second_too():
    """``bench.transfer``'s ucx rows per CPU second of both ends: bytes per second over cores busy."""
    from bench.transfer import _ratio_per_cpu_s

    ucx, tcp = {"median_gbps": 2.0, "cores_busy": 1.6}, {"median_gbps": 2.4, "cores_busy": 1.5}
    assert _ratio_per_cpu_s(ucx, tcp) == {"ratio": round((2.0 / 1.6) / (2.4 / 1.5), 3)}
    assert "skipped" in _ratio_per_cpu_s({}, tcp)
