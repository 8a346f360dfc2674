"""The ``/metrics`` HTTP server of every Tidekv process: bounded, timed out, optionally TLS.

prometheus_client's own server (wsgiref) gives every connection a thread and no deadline, so
300 clients that open a connection and send nothing held 300 threads forever. This one:

- serves at most ``max_connections`` connections at once, each on a thread of a fixed pool;
  one beyond that is answered ``503`` at once and closed (the accept thread never blocks on it);
- gives each connection one deadline, ``request_timeout_s``, for everything: the TLS handshake,
  the request line and headers (at most ``max_request_bytes``), and sending the answer; past
  it the connection is closed (with a ``408`` when the request was incomplete);
- answers ``GET /metrics`` (and ``/``) with ``render()``'s bytes, anything else ``404``/``405``,
  and closes the connection after each answer (``Connection: close``).

Scrapes are small and rare (one per Prometheus per interval), so a handful of connections and
a deadline of seconds cost a real scraper nothing.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class ServerLimits:
    max_connections: int = 8
    request_timeout_s: float = 10.0
    max_request_bytes: int = 8192

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.request_timeout_s <= 0 or self.max_request_bytes < 64:
            raise ValueError(f"metrics server limits out of range: {self}")


def _response(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


BUSY = _response("503 Service Unavailable", b"too many /metrics connections; retry later\n")


class _Late(Exception):
    """The connection's deadline passed."""


class BoundedHttpServer:
    """Serves ``render()`` on ``host:port`` from its own threads until ``stop``. Thread-safe."""

    def __init__(self, host: str, port: int, render: Callable[[], bytes], limits: ServerLimits = ServerLimits(),
                 tls: ssl.SSLContext | None = None):
        self.render, self.limits, self.tls = render, limits, tls
        self._sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                          backlog=128)
        self._sock.settimeout(0.25)  # the accept loop looks at the stop flag this often
        self.port = self._sock.getsockname()[1]
        self._pool = ThreadPoolExecutor(limits.max_connections, thread_name_prefix="metrics-conn")
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="metrics-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops accepting, closes the socket, waits for the open connections (each ends by its deadline)."""
        self._stopped.set()
        self._thread.join(5)
        self._sock.close()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopped.is_set():
                    return
                time.sleep(0.05)  # out of descriptors, say: the next accept may work
                continue
            if not self._slots.acquire(blocking=False):
                self._refuse(conn)
                continue
            try:
                self._pool.submit(self._serve, conn)
            except RuntimeError:  # the pool shut down meanwhile
                self._slots.release()
                conn.close()

    @staticmethod
    def _refuse(conn: socket.socket) -> None:
        try:
            conn.setblocking(False)
            conn.send(BUSY)  # a few bytes: they fit the socket's buffer, or are dropped
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.limits.request_timeout_s
        try:
            conn = self._handshake(conn, deadline)
            head = self._read_head(conn, deadline)
            self._send(conn, self._answer(head), deadline)
        except _Late:
            self._try_send(conn, _response("408 Request Timeout", b"request not complete in time\n"))
        except (OSError, ssl.SSLError, ValueError) as e:
            log.debug("metrics connection ended: %s", e)
        finally:
            conn.close()
            self._slots.release()

    def _handshake(self, conn: socket.socket, deadline: float) -> socket.socket:
        if self.tls is None:
            return conn
        _timeout(conn, deadline)
        tls = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        try:
            tls.do_handshake()
        except TimeoutError:
            raise _Late() from None
        return tls

    def _read_head(self, conn: socket.socket, deadline: float) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            if len(data) > self.limits.max_request_bytes:
                raise ValueError("request headers too large")
            _timeout(conn, deadline)
            try:
                chunk = conn.recv(4096)
            except TimeoutError:
                raise _Late() from None
            if not chunk:
                raise ValueError("connection closed before the request was complete")
            data += chunk
        return data

    def _answer(self, head: bytes) -> bytes:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _response("400 Bad Request", b"not an HTTP request\n")
        method, path = parts[0], parts[1].split(b"?", 1)[0]
        if path not in (b"/metrics", b"/"):
            return _response("404 Not Found", b"only /metrics is served here\n")
        if method != b"GET":
            return _response("405 Method Not Allowed", b"GET /metrics\n")
        return _response("200 OK", self.render(), CONTENT_TYPE)

    @staticmethod
    def _send(conn: socket.socket, data: bytes, deadline: float) -> None:
        """Sends the answer within the deadline; a reader too slow for it is cut off mid-answer."""
        _timeout(conn, deadline)
        try:
            conn.sendall(data)  # one deadline for the whole answer, since Python 3.5
        except TimeoutError:
            log.debug("a /metrics reader did not take the answer in time")

    @staticmethod
    def _try_send(conn: socket.socket, data: bytes) -> None:
        try:
            conn.settimeout(0.1)
            conn.sendall(data)
        except OSError:
            pass


def _timeout(conn: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Late()
    conn.settimeout(left)
