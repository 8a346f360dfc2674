"""A client that leaves during its prefill, and the admission queue's wait, on real
processes: the cancel ends quietly (no traceback in the Conductor's log) and frees the pages
on both workers; a queued request waits for the sooner of its deadline (DEADLINE_EXCEEDED)
and --max-queue-wait-s (RESOURCE_EXHAUSTED), as conductor/admission.py says."""

import time

import grpc
import pytest

from conductor.client import Client
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
