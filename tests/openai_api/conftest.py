"""A real local cluster (Conductor + 1 prefill + 1 decode, block size 16) with the HTTP front
started as its own process (``python -m openai_api``) in front of it; both stopped at the end."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

import engine
from deploy.local import ClusterConfig, LocalCluster, free_port
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"


def make_cluster(conductor_args: tuple[str, ...] = ()) -> LocalCluster:
    return LocalCluster(ClusterConfig(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS,
                                      decode_args=DECODE_ARGS, conductor_args=conductor_args))


class HttpFront:
    """``python -m openai_api`` as a subprocess; its log is kept in a temporary file."""

    def __init__(self, conductor: str, *extra: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._dir = Path(tempfile.mkdtemp(prefix="tidekv-http-"))
        cmd = [sys.executable, "-m", "openai_api", "--conductor", conductor, "--port", str(self.port), *extra]
        env = {**os.environ, "TIDEKV_TORCH_THREADS": "1"}
        with open(self._dir / "http.log", "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log_text(self) -> str:
        return (self._dir / "http.log").read_text()

    def wait_up(self, timeout_s: float = 60.0) -> HttpFront:
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                raise RuntimeError(f"http front exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"http front not up within {timeout_s:.0f}s:\n{self.log_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture(scope="session")
def reference():
    return engine.load_model(MODEL)


@pytest.fixture(scope="session")
def cluster():
    with make_cluster() as c:
        yield c


@pytest.fixture(scope="session")
def front(cluster):
    f = HttpFront(cluster.endpoint).wait_up()
    yield f
    f.stop()
