"""The ucx backend's own mechanics (its contract tests run with every backend in
``test_transfer.py`` and ``test_transfer_auth.py``): ucxx is installed by the test install and
works here without a GPU (UCX over tcp on loopback); abandoned UCX operations are collected
(every exception retrieved) and logged once per link, in one line, when it closes; a killed
peer leaves no exception unretrieved; ``shutdown_ucx`` stops ucxx's notifier thread.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import subprocess
import sys
import time

import pytest

from kvstore.transfer import TransferConfig, TransferError, connect, ucx_unavailable_reason
from kvstore.transfer.orphans import Orphans, num_parked
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
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "notifier threads after shutdown: []" in done.stdout, done.stdout
