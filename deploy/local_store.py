"""The store a local cluster of Conductor replicas shares: a ``redis-server`` on 127.0.0.1,
started and supervised by ``deploy.local.LocalCluster``.

It requires AUTH (a password made once per data dir, 0600, given to the Conductors as a file,
never on a command line: the server reads it from its own 0600 config file), keeps an
append-only file in its directory so a restart finds the log again, and binds loopback only.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

from runtime.ports import free_port


class LocalStore:
    def __init__(self, directory: Path, port: int = 0):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise ValueError("Conductor replicas share their state in Redis: install redis-server (Debian package "
                             "redis-server), or give --index redis://HOST:PORT of a store you run")
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.password_file = directory / "password"
        if not self.password_file.exists():
            _write_private(self.password_file, secrets.token_hex(24) + "\n")
        self.log_path = directory / "redis.log"
        self._config = directory / "redis.conf"
        password = self.password_file.read_text().strip()
        _write_private(self._config, "\n".join([
            "bind 127.0.0.1", f"port {self.port}", "protected-mode yes", f"dir {directory}", 'save ""',
            "appendonly yes", "appendfsync everysec", f"requirepass {password}", f"logfile {self.log_path}", ""]))

    def launch(self) -> subprocess.Popen:
        return subprocess.Popen([self.binary, str(self._config)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password_file.read_text().strip(),
                           socket_timeout=1, socket_connect_timeout=1)

    def wait_ready(self, timeout_s: float) -> None:
        import redis

        until = time.monotonic() + timeout_s
        client = self.client()
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.exceptions.RedisError:
                    if time.monotonic() > until:
                        tail = self.log_path.read_text()[-2000:] if self.log_path.exists() else ""
                        raise RuntimeError(f"the store (redis-server on {self.port}) did not start:\n{tail}") from None
                time.sleep(0.05)
        finally:
            client.close()


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
