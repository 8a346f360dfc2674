"""Parent-side helpers of the transfer tests: ``BACKENDS`` (every backend; ucx is part of the
test install, ``scripts/dev.sh test``, so its tests never skip), ``Peer``, a
``transfer_peer.py`` child process whose JSON lines arrive on a queue, killed at teardown
(the ``spawn`` fixture of conftest), and ``send_args``, the command line of a peer that sends
one request to a receiver."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvstore.transfer import Receiver

REPO_ROOT = Path(__file__).resolve().parents[2]
PEER_SCRIPT = Path(__file__).with_name("transfer_peer.py")
EVENT_TIMEOUT_S = 30.0
BACKENDS = ["shm", "tcp", "ucx"]


def send_args(rx: Receiver, rid: str, *extra: str) -> list[str]:
    """``spawn`` arguments of a ``transfer_peer.py`` that sends request ``rid`` to ``rx``."""
    return ["send", "--address", rx.address, "--rid", rid, *extra]


class Peer:
    """A ``transfer_peer.py`` child; its JSON lines arrive on ``events``. Killed at teardown."""

    def __init__(self, *args: str):
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the child
        python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": python_path}
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), *args],
            cwd=REPO_ROOT,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        self.events: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))

    def event(self, name: str) -> dict:
        try:
            event = self.events.get(timeout=EVENT_TIMEOUT_S)
        except queue.Empty:
            self._stderr.seek(0)
            pytest.fail(f"peer sent no {name!r} event; stderr:\n{self._stderr.read()[-4000:]}")
        assert event["event"] == name, event
        return event

    def tell(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        self._stderr.close()
