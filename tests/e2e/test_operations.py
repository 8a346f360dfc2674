"""Operating a cluster: the index in a real Redis (surviving a Conductor restart), and
SIGTERM draining in-flight requests."""

import signal
import threading

import pytest

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt, run_all


def test_redis_index_survives_conductor_restart(redis_server_factory, reference):
    redis = redis_server_factory()
    config = ClusterConfig(num_prefill=1, num_decode=1, index=redis.url.rsplit("/", 1)[0],
                           prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS)
    with LocalCluster(config) as cluster:
        base = prompt(200, 500)
        a = run_all(cluster.endpoint, [Client.request(base, max_tokens=3)])[0]
        assert a.cached_tokens == 0
        b = run_all(cluster.endpoint, [Client.request(base[:160] + prompt(30, 501), max_tokens=5)])[0]
        assert b.cached_tokens == 160  # matched through the index held in Redis
        cluster.restart_conductor()
        second = base[:192] + prompt(20, 502)
        c = run_all(cluster.endpoint, [Client.request(second, max_tokens=6)])[0]
        assert c.cached_tokens == 192  # the new Conductor routes by the blocks it found in Redis
        assert c.token_ids == engine.generate(reference, second, 6)


@pytest.mark.parametrize("target", ["cluster", "decode-0"])
def test_sigterm_drains_in_flight_requests(reference, target):
    """SIGTERM to the whole cluster (front to back) or to the decode worker alone while a
    request decodes: the request still completes, token-exact."""
    config = ClusterConfig(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS)
    cluster = LocalCluster(config).start()
    ids = prompt(50, 600)
    client = Client(cluster.endpoint)
    started = threading.Event()
    tokens: list[int] = []
    finish: list[int] = []
    try:
        def consume():
            for msg in client.stub.Generate(Client.request(ids, max_tokens=60), timeout=120):
                tokens.extend(msg.token_ids)
                if msg.finish_reason:
                    finish.append(msg.finish_reason)
                started.set()

        t = threading.Thread(target=consume)
        t.start()
        assert started.wait(60)
        if target == "cluster":
            cluster.stop(grace_s=60)
        else:
            cluster.procs[target].send_signal(signal.SIGTERM)
        t.join(60)
        if target != "cluster":
            assert cluster.procs[target].wait(30) == 0  # drained, then exited by itself
    finally:
        cluster.stop()
        client.close()
    assert len(finish) == 1
    assert tokens == engine.generate(reference, ids, 60)
