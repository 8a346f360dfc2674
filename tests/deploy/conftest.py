"""Fixtures of the deploy tests: ``objs``, the objects of the base and of each overlay of
deploy/k8s (``k8s_support.rendered``: rendered once per session, a fresh copy per test)."""

from __future__ import annotations

import pytest

from tests.deploy.k8s_support import TARGETS, rendered


@pytest.fixture(params=TARGETS)
def objs(request: pytest.FixtureRequest) -> list[dict]:
    return rendered(request.param)
