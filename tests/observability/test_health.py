"""gRPC health with real readiness, seen by a grpc.health.v1 client as a probe would: the
Conductor is NOT_SERVING until it has a live worker of each role, a worker is SERVING only
once registered and turns NOT_SERVING while it drains (finishing what it holds); the
``tidekv.liveness`` name says only that the process is up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conductor.client import Client
from deploy.local import free_port
from runtime.grpc_server import LIVENESS, channel
from tests.auth_support import SECRET_ENV

ROOT = Path(__file__).resolve().parents[2]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def status(address: str, service: str = "") -> int | None:
    """The health status, or None when nothing answers (the process is not up yet)."""
    ch = channel(address)
    try:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
    except grpc.RpcError:
        return None
    finally:
        ch.close()


def wait_status(address: str, want: int, service: str = "", timeout_s: float = 90) -> int | None:
    until = time.monotonic() + timeout_s
    got = None
    while time.monotonic() < until:
        got = status(address, service)
        if got == want:
            return got
        time.sleep(0.2)
    return got


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **SECRET_ENV})


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def test_readiness_follows_registration_and_drain(procs, tmp_path):
    cport, pport, dport = free_port(), free_port(), free_port()
    conductor = f"127.0.0.1:{cport}"
    procs.append(spawn("--role", "conductor", "--port", str(cport), "--insecure-no-auth"))
    assert wait_status(conductor, SERVING, LIVENESS) == SERVING  # up ...
    assert status(conductor) == NOT_SERVING  # ... but with no worker it cannot serve

    worker = ("--conductor", conductor, "--block-size", "16", "--num-pages", "256")
    procs.append(spawn("--role", "decode", "--port", str(dport), "--worker-id", "d0", *worker))
    decode = f"127.0.0.1:{dport}"
    assert wait_status(decode, SERVING) == SERVING  # registered
    assert status(conductor) == NOT_SERVING  # still no prefill worker
    # its SSD tier under tmp_path: the teardown SIGKILLs it, and a temporary one would stay in /tmp
    procs.append(spawn("--role", "prefill", "--port", str(pport), "--worker-id", "p0", "--data-dir",
                       str(tmp_path / "p0"), *worker))
    assert wait_status(conductor, SERVING) == SERVING
    assert status(conductor, "tidekv.v1.Inference") == SERVING

    client = Client(conductor)
    stream = client.stub.Generate(Client.request([5, 6, 7, 8], max_tokens=300), timeout=120)
    got = [next(stream)]  # the first token: the decode worker now holds the request
    procs[1].send_signal(signal.SIGTERM)
    assert wait_status(decode, NOT_SERVING, timeout_s=10) == NOT_SERVING  # draining ...
    assert status(decode, LIVENESS) == SERVING  # ... alive, finishing what it holds
    got += list(stream)
    assert got[-1].finish_reason and sum(len(m.token_ids) for m in got) == 300
    assert procs[1].wait(timeout=60) == 0
    assert wait_status(conductor, NOT_SERVING, timeout_s=30) == NOT_SERVING  # its decode worker is gone
    client.close()
