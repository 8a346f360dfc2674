"""Liveness between the ranks of one instance: rank 0 knows at once when another rank's
process is gone, and every other rank when rank 0's is.

Owns ``RankWatch`` (rank 0: listens, admits each rank, watches its connection) and
``RankLink`` (another rank: one connection to rank 0). A process that dies has its sockets
closed by the kernel, so the other end reads EOF within milliseconds, whatever it was doing
(rank 0 may be idle between requests, where no collective would notice). Each connection opens
with a mutual challenge under a key derived from the cluster secret, P = ``b"tidekv-rank/1"``::

    rank 0                                           rank r
      nonce0 (32 bytes)                      ──►
                                             ◄──     r (4 bytes) + nonceR + HMAC(K, P + nonce0 + nonceR + r)
      HMAC(K, P + nonceR + nonce0 + r)
        + instance id (2-byte length + bytes) ──►    verify; keep the instance id

Rank 0 hands over the instance id so any rank can deregister the instance (the session key is
derived from it). The handler runs on a daemon thread, once per watch; ``close`` first marks the
ends as expected. The connection carries nothing after the handshake.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
PROTOCOL = b"tidekv-rank/1"
NONCE_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, PROTOCOL + b"".join(parts), hashlib.sha256).digest()


class RankWatch:
    """Rank 0's end. ``on_lost(reason)`` runs once, on a daemon thread, when a joined rank's
    connection ends before ``close``."""

    def __init__(self, host: str, key: bytes, instance_id: str, num_followers: int,
                 on_lost: Callable[[str], None]):
        self._key, self._instance = key, instance_id.encode()
        self._num_followers = num_followers
        self._on_lost = on_lost
        self._sock = socket.create_server((host, 0))
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._joined: dict[int, socket.socket] = {}
        self._all_joined = threading.Event()
        self._closing = False
        self._fired = False
        self._watchers: list[threading.Thread] = []
        threading.Thread(target=self._accept, name="rank-watch", daemon=True).start()

    def wait_joined(self, timeout_s: float) -> None:
        """Blocks until every other rank has joined; RuntimeError naming the missing ranks."""
        if not self._all_joined.wait(timeout_s):
            with self._lock:
                missing = sorted(set(range(1, self._num_followers + 1)) - set(self._joined))
            raise RuntimeError(f"ranks {missing} did not join the instance's watch within {timeout_s:.0f} s")

    def stopping(self) -> None:
        """From now on a rank's connection ending is expected (rank 0 is stopping them)."""
        with self._lock:
            self._closing = True

    def close(self, wait_s: float = 0.0) -> None:
        """Stops watching: waits up to ``wait_s`` for the ranks to close their ends first (they
        would take rank 0 closing its end for rank 0's death), then closes everything."""
        self.stopping()
        until = time.monotonic() + wait_s
        while time.monotonic() < until and any(t.is_alive() for t in self._watchers):
            time.sleep(0.02)
        with self._lock:
            conns = list(self._joined.values())
        self._sock.close()
        for c in conns:
            c.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._admit, args=(conn, peer), name="rank-watch-admit", daemon=True).start()

    def _admit(self, conn: socket.socket, peer: object) -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            nonce = secrets.token_bytes(NONCE_BYTES)
            conn.sendall(nonce)
            head = _recv_exact(conn, 4 + NONCE_BYTES + 32)
            rank_bytes, their, proof = head[:4], head[4 : 4 + NONCE_BYTES], head[4 + NONCE_BYTES:]
            if not hmac.compare_digest(proof, _mac(self._key, nonce, their, rank_bytes)):
                raise PermissionError("wrong proof")
            rank = struct.unpack(">I", rank_bytes)[0]
            if not 1 <= rank <= self._num_followers:
                raise PermissionError(f"rank {rank} outside 1..{self._num_followers}")
            conn.sendall(_mac(self._key, their, nonce, rank_bytes) + struct.pack(">H", len(self._instance))
                         + self._instance)
            conn.settimeout(None)
        except (OSError, PermissionError) as e:
            log.warning("refused a rank connection from %s: %s", peer, e)
            conn.close()
            return
        with self._lock:
            if rank in self._joined or self._closing:
                log.warning("refused a second connection for rank %d from %s", rank, peer)
                conn.close()
                return
            self._joined[rank] = conn
            self._watchers.append(threading.current_thread())
            if len(self._joined) == self._num_followers:
                self._all_joined.set()
        self._watch(rank, conn)

    def _watch(self, rank: int, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.recv(1)  # nothing is ever sent: returns at EOF (or raises on a reset)
        with self._lock:
            if self._closing or self._fired:
                return
            self._fired = True
        self._on_lost(f"rank {rank} of the instance is gone (its connection to rank 0 closed)")


class RankLink:
    """Another rank's end: connects to rank 0 at ``host:port`` and proves it is rank
    ``rank``; ``on_lost(reason)`` runs once, on a daemon thread, when rank 0's end closes."""

    def __init__(self, host: str, port: int, key: bytes, rank: int, on_lost: Callable[[str], None],
                 timeout_s: float = HANDSHAKE_TIMEOUT_S):
        until = time.monotonic() + timeout_s
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=timeout_s)
                break
            except OSError:
                if time.monotonic() > until:
                    raise
                time.sleep(0.1)
        rank_bytes = struct.pack(">I", rank)
        nonce0 = _recv_exact(self._sock, NONCE_BYTES)
        mine = secrets.token_bytes(NONCE_BYTES)
        self._sock.sendall(rank_bytes + mine + _mac(key, nonce0, mine, rank_bytes))
        proof = _recv_exact(self._sock, 32)
        if not hmac.compare_digest(proof, _mac(key, mine, nonce0, rank_bytes)):
            self._sock.close()
            raise PermissionError(f"rank 0 at {host}:{port} failed the rank handshake (another cluster secret?)")
        (length,) = struct.unpack(">H", _recv_exact(self._sock, 2))
        self.instance_id = _recv_exact(self._sock, length).decode()
        self._sock.settimeout(None)
        self._closing = False
        self._on_lost = on_lost
        threading.Thread(target=self._watch, name="rank-link", daemon=True).start()

    def close(self) -> None:
        self._closing = True
        self._sock.close()

    def _watch(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.recv(1)
        if not self._closing:
            self._on_lost("rank 0 of the instance is gone (its connection closed)")
