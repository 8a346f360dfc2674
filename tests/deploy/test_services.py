"""The roles as services: embedded in this process through ``build(config)``, and as three
``tidekv serve`` processes started one by one (as a user would across machines), one worker
advertising an address other than the one it binds.

Every request must equal ``engine.generate`` token for token; every test ends with nothing of
its own left running (threads, ports, processes, temporary directories).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

import engine
from conductor.client import Client
from conductor.config import ConductorConfig
from conductor.server import build as build_conductor
from decode_worker.config import DecodeConfig
from decode_worker.server import build as build_decode
from deploy.local import free_port
from prefill_worker.config import PrefillConfig
from prefill_worker.server import build as build_prefill
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.service import Service
from tests.auth_support import SECRET_ENV, SECRET_FILE, operator_channel
from tests.e2e.helpers import prompt, run_all

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16
SAMPLING = [dict(), dict(temperature=0.8, top_p=0.9, top_k=40, seed=17)]
SERVICE_THREADS = ("worker-link", "decode-loop", "reaper")


@pytest.fixture(scope="module")
def reference():
    return engine.load_model("tiny")


def check_exact(endpoint: str, reference, lengths: list[int], max_tokens: int = 8) -> None:
    reqs, want = [], []
    for i, n in enumerate(lengths):
        ids, s = prompt(n, 40 + i), SAMPLING[i % len(SAMPLING)]
        reqs.append(Client.request(ids, max_tokens=max_tokens, **s))
        want.append(engine.generate(reference, ids, max_tokens, **s))
    for out, w in zip(run_all(endpoint, reqs), want, strict=True):
        assert out.num_terminal == 1 and out.finish_reason == "length", out.error
        assert out.token_ids == w


def registered(endpoint: str) -> list[ipb.WorkerInfo]:
    ch = operator_channel(endpoint)
    try:
        return list(igrpc.RegistryStub(ch).Workers(ipb.WorkersRequest(), timeout=5).workers)
    finally:
        ch.close()


def wait_until(predicate, timeout_s: float, what: str) -> None:
    until = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < until, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.1)


def refuses_connections(address: str) -> bool:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return False
    except OSError:
        return True


# ---- (a) the three roles embedded in this process --------------------------------------------

def test_roles_embedded_in_one_process(reference):
    conductor = build_conductor(ConductorConfig(port=free_port(), policy="round_robin", insecure_no_auth=True,
                                                cluster_secret_file=SECRET_FILE))
    conductor.start()
    workers: list[Service] = []
    try:
        assert conductor.address and not conductor.ready()  # serving, but no worker of either role yet
        common = dict(conductor=conductor.address, block_size=BLOCK, cluster_secret_file=SECRET_FILE)
        workers = [build_prefill(PrefillConfig(worker_id="prefill-e", num_pages=256, **common)),
                   build_decode(DecodeConfig(worker_id="decode-e", num_pages=512, **common))]
        for w in workers:
            assert isinstance(w, Service) and not w.ready()
            w.start()
        wait_until(lambda: all(w.ready() for w in workers), 60, "both workers registered")
        wait_until(conductor.ready, 10, "the Conductor ready with a worker of each role")
        assert {w.worker_id for w in registered(conductor.address)} == {"prefill-e", "decode-e"}
        check_exact(conductor.address, reference, [7, 40, 90])
        data_dir = workers[0].data_dir
        assert Path(data_dir).is_dir()
    finally:
        conductor.drain(5)
        for w in workers:
            w.drain(5)
            w.stop()
        conductor.stop()
    assert not conductor.ready() and not any(w.ready() for w in workers)
    addresses = [conductor.address] + [a for w in workers for a in (w.address, w.transfer_address)]
    assert all(refuses_connections(a) for a in addresses), addresses
    left = [t.name for t in threading.enumerate() if t.name in SERVICE_THREADS]
    assert not left, f"threads still running after stop: {left}"
    assert not Path(data_dir).exists(), "the temporary SSD directory the worker made is removed"


def test_a_failed_start_leaves_nothing_behind():
    worker = build_prefill(PrefillConfig(conductor="127.0.0.1:1", max_frame_bytes=1024,
                                         cluster_secret_file=SECRET_FILE))
    with pytest.raises(ValueError, match="max-frame-bytes"):
        worker.start()
    assert not worker.ready()
    with pytest.raises(ValueError, match="--conductor"):
        build_decode(DecodeConfig())
    with pytest.raises(ValueError, match="--cluster-secret-file"):
        build_decode(DecodeConfig(conductor="127.0.0.1:1"))


# ---- (b, c) three `tidekv serve` processes -----------------------------------------------------

class ServeProcesses:
    """``python -m deploy.cli serve --role R`` processes; ``stop`` sends SIGTERM and waits."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, role: str, args: list[str], env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "deploy.cli", "serve", "--role", role, *args]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEKV_")}
        full_env |= {"TIDEKV_TORCH_THREADS": "1", **SECRET_ENV, **env}
        with open(self.log_dir / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            assert p.poll() is None, f"{name} exited with {p.returncode}:\n{self.log(name)[-2000:]}"

    def stop(self) -> dict[str, int | None]:
        """SIGTERM to each (workers first would strand requests: the Conductor goes first), then
        the exit codes; SIGKILL (and None) for one that outlives its drain."""
        codes: dict[str, int | None] = {}
        for name, p in self.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                codes[name] = p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes[name] = None
        return codes


@pytest.fixture(scope="module")
def serve_cluster(tmp_path_factory):
    """Conductor, prefill and decode started one by one, some settings as flags and some as
    ``TIDEKV_*`` variables. The prefill worker binds every interface and advertises 127.0.0.2."""
    procs = ServeProcesses(tmp_path_factory.mktemp("serve-logs"))
    endpoint = f"127.0.0.1:{free_port()}"
    try:
        procs.spawn("conductor", "conductor", ["--port", endpoint.rsplit(":", 1)[1]],
                    {"TIDEKV_POLICY": "round_robin", "TIDEKV_WORKER_TTL_S": "3", "TIDEKV_INSECURE_NO_AUTH": "1"})
        def conductor_up() -> bool:
            procs.check_alive()
            return "serving on" in procs.log("conductor")

        wait_until(conductor_up, 60, "conductor up")
        procs.spawn("prefill", "prefill",
                    ["--conductor", endpoint, "--host", "0.0.0.0", "--advertise-host", "127.0.0.2",
                     "--worker-id", "prefill-s"],
                    {"TIDEKV_BLOCK_SIZE": str(BLOCK), "TIDEKV_NUM_PAGES": "256"})
        procs.spawn("decode", "decode", ["--block-size", str(BLOCK)],
                    {"TIDEKV_CONDUCTOR": endpoint, "TIDEKV_WORKER_ID": "decode-s", "TIDEKV_NUM_PAGES": "512"})

        def both_registered() -> bool:
            procs.check_alive()
            try:
                return len(registered(endpoint)) == 2
            except grpc.RpcError:
                return False

        wait_until(both_registered, 120, "both workers registered")
        yield procs, endpoint
    finally:
        codes = procs.stop()
    assert codes == {"conductor": 0, "prefill": 0, "decode": 0}, codes


def test_worker_registers_its_advertise_host(serve_cluster):
    procs, endpoint = serve_cluster
    by_id = {w.worker_id: w for w in registered(endpoint)}
    prefill, decode = by_id["prefill-s"], by_id["decode-s"]
    assert prefill.rpc_address.startswith("127.0.0.2:"), prefill.rpc_address
    assert prefill.transfer_address.startswith("tcp://127.0.0.2:"), prefill.transfer_address
    assert decode.rpc_address.startswith("127.0.0.1:") and decode.transfer_address.startswith("tcp://127.0.0.1:")
    assert f"prefill worker prefill-s serving on {prefill.rpc_address}" in procs.log("prefill")
    assert f"conductor serving on {endpoint} (policy round_robin" in procs.log("conductor")


def test_roles_started_one_by_one_serve_token_exact(serve_cluster, reference):
    procs, endpoint = serve_cluster
    check_exact(endpoint, reference, [12, 50, 100, 33])
    procs.check_alive()
