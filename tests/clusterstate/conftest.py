"""Fixtures of the cluster-state tests (the Redis ones come from tests/redis_fixtures.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.clusterstate.state_support import Harness


@pytest.fixture(params=["memory", "redis"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    h = Harness(request.param, url)
    try:
        yield h
    finally:
        h.close()
