"""Fixtures of the cost-model tests: the tiny model once per session, and the marker of the
tests that run real measurements (short, CI-safe: they assert shapes of results, never speed)."""

import pytest

import engine


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "calibration: runs real (short) measurements of the engine and transfer engine")


@pytest.fixture(scope="session")
def tiny():
    return engine.load_model("tiny")
