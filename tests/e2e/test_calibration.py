"""`tidekv calibrate` writes a file the Conductor loads and schedules with; a corrupt file stops
the Conductor at start with an error naming it; a calibration made for another model makes
the Conductor refuse workers of this one, naming the file. Real processes throughout."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

import engine
from conductor.client import Client
from costmodel import CalibrationInfo, load_models, save_models
from costmodel.builtin import tiny_cpu_estimate
from deploy.local import free_port
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.auth import CONDUCTOR, Member, worker_principal
from runtime.grpc_server import channel
from tests.auth_support import SECRET_ENV, SECRET_FILE
from tests.e2e.conftest import make_cluster
from tests.e2e.helpers import prompt

ROOT = Path(__file__).resolve().parents[2]


def tidekv(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


def test_calibrate_writes_a_file_the_conductor_schedules_with(tmp_path, reference):
    out = tmp_path / "tiny.json"
    done = tidekv("calibrate", "--model", "tiny", "--grid", "smoke", "--block-size", "16", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "held-out relative error" in done.stdout
    costs = load_models(out, model_fingerprint=reference.fingerprint)
    assert costs.prefill_s(256, 0) > 0 and costs.info.block_size == 16
    with make_cluster(1, 1, conductor_args=("--calibration", str(out))) as c:
        log = (c.data_dir / "logs" / "conductor.log").read_text()
        assert f"cost models from {out}" in log
        ids = prompt(120, 7)
        got = Client(c.endpoint).generate(Client.request(ids, max_tokens=6))
        assert got.token_ids == engine.generate(reference, ids, 6)
        assert got.predicted_ttft_s > 0  # predicted from the calibration


def test_a_corrupt_calibration_stops_the_conductor_naming_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "tidekv-calibration", "version": 1, "prefill": ')
    done = tidekv("serve", "--role", "conductor", "--port", str(free_port()), "--calibration", str(bad),
                  timeout_s=120)
    assert done.returncode != 0
    assert str(bad) in done.stderr


def test_a_calibration_for_another_model_refuses_this_models_workers(tmp_path, reference):
    other = dataclasses.replace(tiny_cpu_estimate(), info=CalibrationInfo(model_fingerprint="another-model",
                                                                          device="cpu", torch_threads=1))
    path = tmp_path / "other.json"
    save_models(other, path)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--role", "conductor", "--port", str(port),
                             "--calibration", str(path), "--insecure-no-auth"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **SECRET_ENV})
    try:
        member = Member(Path(SECRET_FILE).read_text().encode(), worker_principal("p0"))
        stub = igrpc.RegistryStub(member.channel(f"127.0.0.1:{port}", audience=CONDUCTOR))
        info = ipb.WorkerInfo(worker_id="p0", role=ipb.WORKER_ROLE_PREFILL, rpc_address="127.0.0.1:1",
                              transfer_address="tcp://127.0.0.1:2", model_fingerprint=reference.fingerprint,
                              block_size=16, num_pages_total=8, instance_id="0123456789abcdef0123")
        grpc.channel_ready_future(channel(f"127.0.0.1:{port}")).result(timeout=60)
        resp = stub.Register(ipb.RegisterRequest(info=info), timeout=10)
        assert not resp.accepted
        assert str(path) in resp.reason and "another-model" in resp.reason and reference.fingerprint in resp.reason
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the Conductor did not stop on SIGTERM")
