"""Free ports for the servers a launcher or a test starts and names in advance.

A port picked by binding port 0 comes from the kernel's ephemeral range, which outgoing
connections draw from too: between the pick and the server's own bind, any client on the host
can take it (``Address already in use``). ``free_port`` picks outside that range instead (in
the larger span left, from ``LOWEST_PORT`` up to it with Linux's default range), where only an
explicit bind can land; it tests that the port binds and never hands the same one out twice in
one process.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

LOWEST_PORT = 20_000  # above Ray's default worker ports (10002-19999) and the usual service ports
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_RANGE = (32_768, 60_999)  # Linux's default
TRIES = 200

_handed_out: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()  # seeded from the OS: two processes pick different ports


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive), or Linux's default where unreadable."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing is bound to now and that no outgoing connection will
    take (outside the ephemeral range); a port-0 pick if none is found in ``TRIES`` tries."""
    low, high = ephemeral_range()
    spans = [(a, b) for a, b in ((LOWEST_PORT, low - 1), (high + 1, 65_535)) if b >= a]
    a, b = max(spans, key=lambda span: span[1] - span[0]) if spans else (0, -1)
    with _lock:
        for _ in range(TRIES if spans else 0):
            port = _rng.randint(a, b)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        _handed_out.add(port)
        return port
