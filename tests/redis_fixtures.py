"""Fixtures: real ``redis-server`` processes on 127.0.0.1 (loaded by tests/conftest.py).

``redis_server`` is one server shared by the session (tests isolate themselves with unique
namespaces); ``redis_server_factory`` starts private servers that a test may kill and
restart, or pause (SIGSTOP: a hung server that accepts connections and never answers). Every
server runs without persistence in a temp dir and is always killed.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from deploy.local import free_port

REDIS_BINARY = "redis-server"
START_TIMEOUT_S = 10.0


class RedisServer:
    """One ``redis-server`` process; ``start``/``kill`` may be repeated on the same port.
    ``password``: AUTH required (``requirepass``, and ``masterauth`` for a replica);
    ``replica_of``: the port of the primary this server replicates."""

    def __init__(self, binary: str, data_dir: Path, port: int, password: str = "", replica_of: int = 0) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.port = port
        self.password = password
        self.replica_of = replica_of
        self.url = f"redis://127.0.0.1:{port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password or None, **kwargs)

    def start(self) -> None:
        assert self._proc is None, "already running"
        log_path = self.data_dir / "redis.log"
        argv = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(self.data_dir), "--logfile", str(log_path)]
        if self.password:
            argv += ["--requirepass", self.password, "--masterauth", self.password]
        if self.replica_of:
            argv += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = self.client(socket_connect_timeout=0.2)
        deadline_s = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                if self._proc.poll() is not None:
                    log = log_path.read_text() if log_path.exists() else ""
                    self._proc = None
                    raise RuntimeError(f"redis-server exited at start on port {self.port}:\n{log}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.ConnectionError:
                    if time.monotonic() > deadline_s:
                        self.kill()
                        raise
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server (an abrupt outage) and reap it."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections, the server answers nothing."""
        assert self._proc is not None, "not running"
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause``: the server answers again with its state intact."""
        assert self._proc is not None, "not running"
        self._proc.send_signal(signal.SIGCONT)


def _binary() -> str:
    path = shutil.which(REDIS_BINARY)
    if path is None:
        pytest.skip(f"{REDIS_BINARY} not on PATH (Debian package redis-server; CI installs it)")
    return path


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    """Start private servers (each on a free port); all are killed at teardown."""
    binary = _binary()
    servers: list[RedisServer] = []

    def start(password: str = "", replica_of: int = 0) -> RedisServer:
        data_dir = tmp_path / f"redis{len(servers)}"
        data_dir.mkdir()
        server = RedisServer(binary, data_dir, free_port(), password, replica_of)
        servers.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.kill()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for the session; tests must use their own namespaces."""
    server = RedisServer(_binary(), tmp_path_factory.mktemp("redis"), free_port())
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


class Sentinels:
    """A Redis primary with one replica, watched by ``num`` real ``redis-sentinel`` processes
    (quorum 1, AUTH on everything) that fail it over a second after it stops answering."""

    SERVICE = "tidekv-primary"

    def __init__(self, factory: Callable[..., RedisServer], data_dir: Path, password: str, num: int = 2) -> None:
        self.password = password
        self.primary = factory(password=password)
        self.replica = factory(password=password, replica_of=self.primary.port)
        self._wait_synced()
        self.ports = [free_port() for _ in range(num)]
        self._procs: list[subprocess.Popen[bytes]] = []
        binary = shutil.which("redis-sentinel") or pytest.skip("redis-sentinel not on PATH (Debian redis-sentinel)")
        for i, port in enumerate(self.ports):
            conf = data_dir / f"sentinel{i}.conf"
            conf.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {data_dir}", f"requirepass {password}",
                f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.primary.port} 1",
                f"sentinel auth-pass {self.SERVICE} {password}",
                f"sentinel down-after-milliseconds {self.SERVICE} 1000",
                f"sentinel failover-timeout {self.SERVICE} 5000", ""]))
            self._procs.append(subprocess.Popen([binary, str(conf), "--logfile", str(data_dir / f"sentinel{i}.log")],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        self.url = f"redis+sentinel://{','.join(f'127.0.0.1:{p}' for p in self.ports)}/{self.SERVICE}"

    def _wait_synced(self) -> None:
        client = self.replica.client(socket_timeout=1)
        deadline_s = time.monotonic() + START_TIMEOUT_S
        try:
            while client.info("replication").get("master_link_status") != "up":
                assert time.monotonic() < deadline_s, "the replica never synced with the primary"
                time.sleep(0.05)
        finally:
            client.close()

    def primary_port(self) -> int:
        """The port the sentinels name as the primary now."""
        for port in self.ports:
            try:
                client = redis.Redis(host="127.0.0.1", port=port, password=self.password, socket_timeout=1)
                host, primary = client.sentinel_get_master_addr_by_name(self.SERVICE)
                client.close()
                return int(primary)
            except redis.exceptions.RedisError:
                continue
        raise RuntimeError("no sentinel answers")

    def close(self) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def sentinels(redis_server_factory, tmp_path: Path) -> Iterator[Sentinels]:
    s = Sentinels(redis_server_factory, tmp_path, "sentinel-test-password")
    try:
        yield s
    finally:
        s.close()
