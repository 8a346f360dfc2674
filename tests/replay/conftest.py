"""A real local cluster (Conductor + 1 prefill + 1 decode, block size 16) for the live replay test."""

import pytest

from deploy.local import ClusterConfig, LocalCluster

BLOCK = 16
WORKER_ARGS = ("--block-size", str(BLOCK), "--snapshot-interval-blocks", "2", "--num-pages", "512")
DECODE_ARGS = ("--block-size", str(BLOCK), "--num-pages", "1024")


@pytest.fixture(scope="module")
def cluster_1x1():
    with LocalCluster(ClusterConfig(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS,
                                    decode_args=DECODE_ARGS)) as c:
        yield c
