import pytest

import engine


@pytest.fixture(scope="session")
def tiny():
    return engine.load_model("tiny")
