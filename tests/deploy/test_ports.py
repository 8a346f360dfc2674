"""``runtime.ports.free_port``: ports a launcher can name before its server binds them."""

from __future__ import annotations

import socket

from runtime import ports
from runtime.ports import LOWEST_PORT, ephemeral_range, free_port


def test_free_ports_are_bindable_distinct_and_outside_the_ephemeral_range():
    low, high = ephemeral_range()
    picked = [free_port() for _ in range(50)]  # not "ports": that is the module the next test patches
    assert len(set(picked)) == len(picked)
    assert all(LOWEST_PORT <= p < low or p > high for p in picked)
    for port in picked[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped(monkeypatch):
    low, _ = ephemeral_range()
    with socket.socket() as held:
        for taken in range(low - 1, LOWEST_PORT, -1):  # a port below the range that binds here
            try:
                held.bind(("127.0.0.1", taken))
                break
            except OSError:
                continue
        proposals = iter([taken, taken, taken - 1])
        monkeypatch.setattr(ports._rng, "randint", lambda a, b: next(proposals))
        assert free_port() == taken - 1
