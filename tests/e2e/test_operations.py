"""Operating a cluster: the index in a real Redis (surviving a Conductor restart), SIGTERM
draining in-flight requests, and workers dying mid-request."""

import signal
import threading
import time

import pytest

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.auth import worker_principal
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt, run_all


def test_redis_index_survives_conductor_restart(redis_server_factory, reference):
    """The lone Conductor crashes and is back 1.5 s later: it routes by the blocks it finds in
    Redis, and the workers keep their leases (no one could hear their heartbeats meanwhile), so
    a request routed at once is not dropped when a worker's link reconnects a moment later."""
    redis = redis_server_factory()
    config = ClusterConfig(num_prefill=1, num_decode=1, index=redis.url.rsplit("/", 1)[0],
                           prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS)
    with LocalCluster(config) as cluster:
        base = prompt(200, 500)
        a = run_all(cluster.endpoint, [Client.request(base, max_tokens=3)])[0]
        assert a.cached_tokens == 0
        b = run_all(cluster.endpoint, [Client.request(base[:160] + prompt(30, 501), max_tokens=5)])[0]
        assert b.cached_tokens == 160  # matched through the index held in Redis
        cluster.restart_conductor(down_s=1.5)
        second = base[:192] + prompt(20, 502)
        c = run_all(cluster.endpoint, [Client.request(second, max_tokens=6)])[0]
        assert (c.finish_reason, c.error) == ("length", "")
        assert c.cached_tokens == 192  # the new Conductor routes by the blocks it found in Redis
        assert c.token_ids == engine.generate(reference, second, 6)
        assert "the workers alive then keep their leases" in (cluster.log_dir / "conductor.log").read_text()


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


def test_decode_worker_killed_mid_stream_ends_request_with_failure(reference):
    """A decode worker SIGKILLed while streaming: the client gets exactly one terminal message,
    FAILED with a reason (no hang, no made-up tokens); the tokens it did get are correct."""
    config = ClusterConfig(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS)
    with LocalCluster(config) as cluster:
        ids = prompt(40, 700)
        client = Client(cluster.endpoint)
        tokens: list[int] = []
        terminal = []
        for msg in client.stub.Generate(Client.request(ids, max_tokens=500), timeout=120):
            tokens.extend(msg.token_ids)
            if len(tokens) >= 3 and cluster.procs["decode-0"].poll() is None:
                cluster.procs["decode-0"].kill()
            if msg.finish_reason:
                terminal.append(msg)
        client.close()
    assert len(terminal) == 1
    assert terminal[0].finish_reason == pb.FINISH_REASON_FAILED and "decode" in terminal[0].error
    assert 3 <= len(tokens) < 500
    assert tokens == engine.generate(reference, ids, len(tokens))


def test_prefill_worker_killed_mid_prefill_fails_request_and_frees_decode(reference):
    """A prefill worker SIGKILLed during a long prefill: one terminal FAILED message, and the
    decode worker frees the reservation whose KV never completed."""
    config = ClusterConfig(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS)
    with LocalCluster(config) as cluster:
        infos = {w.worker_id: w for w in cluster.workers().workers}
        prefill = igrpc.PrefillStub(cluster.channel(infos["prefill-0"].rpc_address, worker_principal("prefill-0")))
        decode = igrpc.DecodeStub(cluster.channel(infos["decode-0"].rpc_address, worker_principal("decode-0")))
        client = Client(cluster.endpoint)
        call = client.stub.Generate(Client.request(prompt(3000, 800), max_tokens=5), timeout=120)
        deadline = time.monotonic() + 60
        while prefill.Stats(ipb.StatsRequest(), timeout=5).num_live_requests == 0:
            assert time.monotonic() < deadline, "the prefill never started"
            time.sleep(0.02)
        cluster.procs["prefill-0"].kill()
        msgs = list(call)
        assert len(msgs) == 1 and msgs[0].finish_reason == pb.FINISH_REASON_FAILED
        assert "prefill" in msgs[0].error
        while decode.Stats(ipb.StatsRequest(), timeout=5).num_live_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = decode.Stats(ipb.StatsRequest(), timeout=5)
        assert stats.num_live_requests == 0 and stats.num_free_pages == stats.num_pages_total
        client.close()


def test_request_retried_on_the_other_prefill_worker_when_its_worker_dies(reference):
    """Two prefill workers; the one prefilling a request is SIGKILLed. The Conductor routes the
    request again to the survivor (nothing had reached the client) and it completes exactly."""
    config = ClusterConfig(num_prefill=2, num_decode=1, prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS)
    with LocalCluster(config) as cluster:
        stubs = {w.worker_id: igrpc.PrefillStub(cluster.channel(w.rpc_address, worker_principal(w.worker_id)))
                 for w in cluster.workers().workers if w.role == ipb.WORKER_ROLE_PREFILL}
        ids = prompt(3000, 900)
        client = Client(cluster.endpoint)
        call = client.stub.Generate(Client.request(ids, max_tokens=6), timeout=180)
        deadline = time.monotonic() + 60
        busy = []
        while not busy:
            assert time.monotonic() < deadline, "no prefill started"
            busy = [w for w, s in stubs.items() if s.Stats(ipb.StatsRequest(), timeout=5).num_live_requests]
            time.sleep(0.02)
        cluster.procs[busy[0]].kill()
        msgs = list(call)
        client.close()
    assert [m.finish_reason for m in msgs if m.finish_reason] == [pb.FINISH_REASON_LENGTH]
    assert msgs[0].prefill_worker != busy[0]
    assert [t for m in msgs for t in m.token_ids] == engine.generate(reference, ids, 6)
