"""Local process clusters: one Conductor plus prefill and decode workers on 127.0.0.1.

``LocalCluster`` starts each role as its own ``tidekv serve`` process, waits until every
worker has registered with the Conductor, and on ``stop`` sends SIGTERM (drain) and then
SIGKILL to whatever is left. Logs go to ``<data_dir>/logs/<name>.log``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.grpc_server import channel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill: int = 1
    num_decode: int = 1
    model: str = "tiny"
    policy: str = "mooncake"
    index: str = "memory"
    calibration: str = ""  # cost-model file for the Conductor ("" = its built-in estimate)
    port: int = 0
    data_dir: str = ""
    threads_per_process: int = 1
    # All roles share this host's cores: prefill is throughput work, decode is latency-bound,
    # so prefill processes run at a lower CPU priority (os.nice) than decode and the Conductor.
    prefill_nice: int = 10
    conductor_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict, hash=False)
    http_port: int = -1  # the OpenAI HTTP front: -1 none, 0 a free port


class LocalCluster:
    def __init__(self, config: ClusterConfig = ClusterConfig()):
        self.config = config
        # A directory made here is removed by stop(); a given one (logs, SSD tiers) is kept.
        self._owns_data_dir = not config.data_dir
        self.data_dir = Path(config.data_dir or tempfile.mkdtemp(prefix="tidekv-up-"))
        self.port = config.port or free_port()
        self.metrics_port = free_port()  # the Conductor's /metrics; workers pick their own
        self.http_port = (config.http_port or free_port()) if config.http_port >= 0 else -1
        self.procs: dict[str, subprocess.Popen] = {}
        # The cluster secret every member proves it knows (runtime.auth); made once per data dir.
        self.secret_file = self.data_dir / "cluster.secret"
        if not self.secret_file.exists():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))

    @property
    def http_url(self) -> str:
        """The OpenAI HTTP front's base URL ("" without one)."""
        return f"http://127.0.0.1:{self.http_port}/v1" if self.http_port > 0 else ""

    def metrics_addresses(self) -> list[str]:
        """Every process's /metrics host:port: the Conductor's and each registered worker's."""
        return [f"127.0.0.1:{self.metrics_port}",
                *(w.metrics_address for w in self.workers().workers if w.metrics_address)]

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _spawn(self, name: str, role: str, args: list[str], nice: int = 0) -> None:
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TIDEKV_TORCH_THREADS": str(self.config.threads_per_process),
               "TIDEKV_CLUSTER_SECRET_FILE": str(self.secret_file), **self.config.env}
        cmd = [sys.executable, "-m", "deploy.cli", "serve", "--role", role, *args]
        with open(logs / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                cwd=Path(__file__).resolve().parent.parent,
                                                preexec_fn=(lambda: os.nice(nice)) if nice else None)

    def _spawn_conductor(self) -> None:
        c = self.config
        calibration = ["--calibration", c.calibration] if c.calibration else []
        self._spawn("conductor", "conductor", ["--port", str(self.port), "--model", c.model, "--policy", c.policy,
                                              "--index", c.index, "--metrics-port", str(self.metrics_port),
                                              *calibration, *c.conductor_args])

    def restart_conductor(self, timeout_s: float = 60.0) -> None:
        """Kills the Conductor (SIGKILL: no drain) and starts a new one on the same port; the
        workers re-register with it (and republish their blocks) on their next heartbeat."""
        old = self.procs.pop("conductor")
        old.kill()
        old.wait()
        self._spawn_conductor()
        self.wait_ready(timeout_s)

    def start(self, timeout_s: float = 120.0) -> LocalCluster:
        c = self.config
        self._spawn_conductor()
        for i in range(c.num_prefill):
            self._spawn(f"prefill-{i}", "prefill", [
                "--conductor", self.endpoint, "--worker-id", f"prefill-{i}", "--model", c.model,
                "--data-dir", str(self.data_dir / f"prefill-{i}"), *c.prefill_args], nice=c.prefill_nice)
        for i in range(c.num_decode):
            self._spawn(f"decode-{i}", "decode", ["--conductor", self.endpoint, "--worker-id", f"decode-{i}",
                                                 "--model", c.model, *c.decode_args])
        try:
            self.wait_ready(timeout_s)
            if self.http_port > 0:
                self._spawn("http", "http", ["--conductor", self.endpoint, "--port", str(self.http_port),
                                             "--model", c.model])
                self._wait_http(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_http(self, timeout_s: float) -> None:
        import urllib.request

        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            if self.procs["http"].poll() is not None:
                tail = (self.data_dir / "logs" / "http.log").read_text()[-2000:]
                raise RuntimeError(f"the HTTP front exited with {self.procs['http'].returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the HTTP front did not answer within {timeout_s:.0f}s")

    def workers(self) -> ipb.WorkersResponse:
        stub = igrpc.RegistryStub(channel(self.endpoint))
        return stub.Workers(ipb.WorkersRequest(), timeout=5)

    def wait_ready(self, timeout_s: float) -> None:
        """Until every worker is registered and alive; RuntimeError naming a process that died."""
        want = self.config.num_prefill + self.config.num_decode
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    tail = (self.data_dir / "logs" / f"{name}.log").read_text()[-2000:]
                    raise RuntimeError(f"{name} exited with {p.returncode} during start-up:\n{tail}")
            try:
                if len(self.workers().workers) >= want:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"cluster not ready within {timeout_s:.0f}s (logs in {self.data_dir / 'logs'})")

    def stop(self, grace_s: float = 20.0) -> None:
        """Drains front to back: SIGTERM the HTTP front, then the Conductor, and wait (in-flight
        requests finish on live workers), then SIGTERM the workers; SIGKILL whatever outlives
        ``grace_s``."""
        until = time.monotonic() + grace_s
        fronts = [[n for n in self.procs if n == "http"], [n for n in self.procs if n == "conductor"]]
        for group in (*fronts, [n for n in self.procs if n not in ("http", "conductor")]):
            for name in group:
                if self.procs[name].poll() is None:
                    self.procs[name].send_signal(signal.SIGTERM)
            for name in group:
                p = self.procs[name]
                try:
                    p.wait(timeout=max(0.1, until - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()
        if self._owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
