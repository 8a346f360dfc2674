"""Real local clusters (Conductor + workers as processes on 127.0.0.1) shared per module."""

import pytest

import engine
from deploy.local import ClusterConfig, LocalCluster

BLOCK = 16
SNAP_EVERY = 2
WORKER_ARGS = ("--block-size", str(BLOCK), "--snapshot-interval-blocks", str(SNAP_EVERY), "--num-pages", "512")
DECODE_ARGS = ("--block-size", str(BLOCK), "--num-pages", "1024")


def make_cluster(num_prefill: int, num_decode: int, policy: str = "mooncake", conductor_args=()):
    return LocalCluster(ClusterConfig(num_prefill=num_prefill, num_decode=num_decode, policy=policy,
                                      prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS,
                                      conductor_args=tuple(conductor_args)))


@pytest.fixture(scope="session")
def reference():
    return engine.load_model("tiny")


@pytest.fixture(scope="module")
def cluster_1x1():
    with make_cluster(1, 1) as c:
        yield c


@pytest.fixture(scope="module")
def cluster_2x2():
    with make_cluster(2, 2, policy="round_robin") as c:
        yield c
