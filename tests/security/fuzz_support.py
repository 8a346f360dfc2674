"""Shared pieces of the fuzz tests (``test_fuzz_*.py``): ``fuzz``, the hypothesis settings
every one of them runs under, and ``mutate``, the overwrite-then-truncate damage applied to
valid encodings (a serialized request, an encoded block payload).

Every run is derandomized (CI sees the same examples each time) and keeps no example database.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def fuzz(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def mutate(data: bytes, position: int, new: bytes, cut: int) -> bytes:
    """``data`` with ``new`` written over it at ``position`` (wrapped) and then ``cut`` bytes
    removed from the end."""
    if data:
        position %= len(data)
        data = data[:position] + new + data[position + len(new):]
    return data[:len(data) - cut] if cut < len(data) else b""
