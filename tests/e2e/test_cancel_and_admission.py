"""A client that leaves during its prefill, and the admission queue's wait, on real
processes: the cancel ends quietly (no traceback in the Conductor's log) and frees the pages
on both workers; a client that leaves while its request is queued takes it out of the queue,
and it is never placed; a queued request waits for the sooner of its deadline
(DEADLINE_EXCEEDED) and --max-queue-wait-s (RESOURCE_EXHAUSTED), as conductor/admission.py says."""

import time

import grpc
import pytest

from conductor.client import Client
from observe.top import scrape
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.auth import worker_principal
from tests.e2e.conftest import make_cluster
from tests.e2e.helpers import prompt, wait_all_freed


@pytest.fixture(scope="module")
def one_slot():
    """One request running at a time; a queued one waits at most 2 s unless its deadline is sooner."""
    with make_cluster(1, 1, policy="round_robin", conductor_args=("--max-running", "1", "--max-queue-wait-s", "2")) \
            as cluster:
        yield cluster


def _prefilling(cluster, timeout_s: float = 60.0) -> None:
    infos = {w.worker_id: w for w in cluster.workers().workers}
    stub = igrpc.PrefillStub(cluster.channel(infos["prefill-0"].rpc_address, worker_principal("prefill-0")))
    until = time.monotonic() + timeout_s
    while stub.Stats(ipb.StatsRequest(), timeout=5).num_live_requests == 0:
        assert time.monotonic() < until, "the prefill never started"
        time.sleep(0.02)


def test_a_client_leaving_during_prefill_ends_quietly_and_frees_both_workers(one_slot):
    client = Client(one_slot.endpoint)
    call = client.stub.Generate(Client.request(prompt(3000, 900), max_tokens=50), timeout=120)
    _prefilling(one_slot)
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    stats = wait_all_freed(one_slot)
    assert all(s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total for s in stats.values()), stats
    out = client.generate(Client.request(prompt(20, 901), max_tokens=3))  # the slot was given back
    assert out.finish_reason == "length"
    client.close()
    log = (one_slot.log_dir / "conductor.log").read_text()
    assert "Traceback" not in log and "Exception" not in log, log[-3000:]


def _num_waiting(cluster) -> float:
    """The Conductor's admission queue length (its ``num_requests_waiting`` gauge)."""
    return sum(value for metric, _, value in scrape(f"127.0.0.1:{cluster.metrics_ports[0]}", timeout_s=10)
               if metric == "tidekv:num_requests_waiting")


def test_a_client_leaving_the_admission_queue_is_never_placed(one_slot):
    """The queued request's client leaves, then the running one's frees the slot (well inside
    the 2 s cap). Before, the queued request was granted that slot anyway: it reserved pages on
    the decode worker and prefilled for nobody, and the reservation outlived every call (until
    its TTL, 120 s), so the workers were never all freed, and a draining decode worker waited
    out its drain timeout for it."""
    client = Client(one_slot.endpoint)
    holder = client.stub.Generate(Client.request(prompt(3000, 905), max_tokens=1000), timeout=120)
    try:
        _prefilling(one_slot)  # the one running slot is taken
        queued = client.stub.Generate(Client.request(prompt(20, 906), max_tokens=2), timeout=120)
        until = time.monotonic() + 60
        while _num_waiting(one_slot) != 1:
            assert time.monotonic() < until, "the second request never queued"
            time.sleep(0.02)
        queued.cancel()
        holder.cancel()
        for call in (queued, holder):
            with pytest.raises(grpc.RpcError) as e:
                list(call)
            assert e.value.code() == grpc.StatusCode.CANCELLED
        stats = wait_all_freed(one_slot)
        assert all(s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total for s in stats.values()), stats
        assert _num_waiting(one_slot) == 0
        out = client.generate(Client.request(prompt(20, 907), max_tokens=3))  # no slot was lost either
        assert out.finish_reason == "length"
    finally:
        holder.cancel()
        client.close()


def test_the_admission_wait_ends_at_the_deadline_or_the_cap(one_slot):
    client = Client(one_slot.endpoint)
    # 1,000 tokens take seconds on any CPU (milliseconds a step): it holds the slot past both waits.
    holder = client.stub.Generate(Client.request(prompt(3000, 902), max_tokens=1000), timeout=120)
    _prefilling(one_slot)  # the one running slot is taken
    try:
        short = Client.request(prompt(20, 903), max_tokens=2)
        short.deadline_s = 0.5  # sooner than the 2 s cap
        with pytest.raises(grpc.RpcError) as e:
            client.generate(short)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "waited 0.5s" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            client.generate(Client.request(prompt(20, 904), max_tokens=2))  # the 300 s default deadline
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waited 2.0s" in e.value.details()
    finally:
        holder.cancel()
        client.close()
    wait_all_freed(one_slot)
