"""Raw-socket clients for attacking HTTP servers in tests: many slow connections, huge bodies.

``slow_clients`` opens ``n`` connections at once, reads what each got before it sent a byte
(a server over its connection limit answers then), sends each kept connection ``opening`` and
then one byte of ``drip`` every ``interval_s``, until the server closes it or ``max_s``
passes. ``push_body`` sends a request's headers and then body bytes until the server answers
or closes. Nothing here waits on the server's speed except through the explicit bounds.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Conn:
    sock: socket.socket
    received: bytes = b""
    closed: bool = False  # the server closed it (EOF or reset)
    refused_at_once: bool = False  # answered and closed before the client sent anything
    sent: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def status(self) -> int:
        """The HTTP status of the first response received, 0 for none."""
        line = self.received.split(b"\r\n", 1)[0].split()
        return int(line[1]) if len(line) >= 2 and line[0].startswith(b"HTTP/") and line[1].isdigit() else 0


def _read(conn: Conn) -> None:
    try:
        while True:
            data = conn.sock.recv(65536)
            if not data:
                conn.closed = True
                return
            conn.received += data
    except (BlockingIOError, ssl.SSLWantReadError):
        return
    except (ConnectionResetError, BrokenPipeError, ssl.SSLError, OSError):
        conn.closed = True


def _connect(address: tuple[str, int], context: ssl.SSLContext | None) -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    if context is not None:
        sock = context.wrap_socket(sock, server_hostname=address[0])
    sock.setblocking(False)
    return sock


def _send(conn: Conn, data: bytes) -> None:
    try:
        conn.sock.send(data)
        conn.sent += len(data)
    except (BlockingIOError, ssl.SSLWantWriteError):
        pass
    except OSError:
        conn.closed = True


def slow_clients(address: tuple[str, int], n: int, opening: bytes, drip: bytes, interval_s: float, max_s: float,
                 context: ssl.SSLContext | None = None, settle_s: float = 0.5) -> list[Conn]:
    conns = [Conn(_connect(address, context)) for _ in range(n)]
    time.sleep(settle_s)  # a refusal at connect time has arrived by now
    for c in conns:
        _read(c)
        c.refused_at_once = c.closed or bool(c.received)
    kept = [c for c in conns if not c.refused_at_once]
    for c in kept:
        try:
            c.sock.setblocking(True)
            c.sock.sendall(opening)
            c.sock.setblocking(False)
            c.sent += len(opening)
        except OSError:
            c.closed = True
    until, next_drip, i = time.monotonic() + max_s, time.monotonic() + interval_s, 0
    while any(not c.closed for c in kept) and time.monotonic() < until:
        for c in kept:
            if not c.closed:
                _read(c)
        if time.monotonic() >= next_drip:
            byte = drip[i % len(drip):i % len(drip) + 1]
            i += 1
            for c in kept:
                if not c.closed:
                    _send(c, byte)
            next_drip += interval_s
        time.sleep(0.02)
    for c in conns:
        c.sock.close()
    return conns


def push_body(address: tuple[str, int], head: bytes, chunk: bytes, max_bytes: int, timeout_s: float = 60.0,
              context: ssl.SSLContext | None = None) -> Conn:
    """Sends ``head`` and then ``chunk`` after ``chunk`` (up to ``max_bytes`` of body) while a
    reader thread collects the answer; stops when the server answered and closed, or refused."""
    sock = socket.create_connection(address, timeout=timeout_s)
    if context is not None:
        sock = context.wrap_socket(sock, server_hostname=address[0])
    conn = Conn(sock)

    def reader() -> None:
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                conn.received += data
        except OSError:
            pass
        conn.closed = True

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        sock.sendall(head)
        while conn.sent < max_bytes and not conn.closed:
            sock.sendall(chunk)
            conn.sent += len(chunk)
    except OSError:
        pass  # the server stopped reading and closed: what it answered is in conn.received
    t.join(timeout_s)
    sock.close()
    return conn
