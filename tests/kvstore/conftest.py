"""Fixtures of the kvstore tests (the Redis ones come from tests/redis_fixtures.py); ``spawn``
starts transfer peers (``transfer_support.Peer``) and kills them all at teardown."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kvstore.index_support import Harness
from tests.kvstore.transfer_support import Peer


@pytest.fixture(params=["memory", "redis"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    h = Harness(request.param, url)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def spawn() -> Iterator:
    peers: list[Peer] = []

    def start(*args: str) -> Peer:
        peers.append(Peer(*args))
        return peers[-1]

    yield start
    for peer in peers:
        peer.close()
