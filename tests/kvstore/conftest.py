"""Fixtures of the kvstore tests; ``spawn``
starts transfer peers (``transfer_support.Peer``) and kills them all at teardown."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kvstore.transfer_support import Peer


@pytest.fixture
def spawn() -> Iterator:
    peers: list[Peer] = []

    def start(*args: str) -> Peer:
        peers.append(Peer(*args))
        return peers[-1]

    yield start
    for peer in peers:
        peer.close()
