"""Issue 20's finding 3, reproduced against a real cluster (Conductor + 2 prefill + 1 decode
processes on loopback, and one more decode worker process that reaches the Conductor only
through a relay): signatures must bind the body, the audience and the server's start.

- the relay rewrites the worker's address inside its signed Register (to the relay's own,
  so the Conductor would send it Prefill and Decode calls): refused, naming the body; the
  same call unaltered is accepted;
- a signed Stats call to one worker, replayed to another: refused, naming the audience;
- a Register that the Conductor accepted, replayed to it after a SIGKILL and a restart
  (within the skew window, where its fresh nonce memory would take it): refused, naming
  the floor.

After each, the cluster serves token-exact answers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc
import pytest

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.auth import AUTH_HEADER, MAX_SKEW_S, worker_principal
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt
from tests.security.relay import Relay, Seen, send

REGISTER = "/tidekv.v1.Registry/Register"
EXTRA = "decode-9"  # the worker behind the relay


@pytest.fixture(scope="module")
def cluster():
    config = ClusterConfig(num_prefill=2, num_decode=1, policy="round_robin", prefill_args=WORKER_ARGS,
                           decode_args=DECODE_ARGS)
    with LocalCluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    return engine.load_model("tiny")


@pytest.fixture(scope="module")
def relayed(cluster, tmp_path_factory):
    """A relay in front of the Conductor, and decode worker ``EXTRA`` dialling the Conductor
    through it (a real process with the cluster secret: the honest party)."""
    relay = Relay(cluster.endpoint)
    relay.rewrite = to_address(relay.address)
    log_path = tmp_path_factory.mktemp("relayed") / f"{EXTRA}.log"
    env = {**os.environ, "TIDEKV_CLUSTER_SECRET_FILE": str(cluster.secret_file), "TIDEKV_TORCH_THREADS": "1"}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--role", "decode", "--conductor",
                                 relay.address, "--worker-id", EXTRA, "--model", "tiny", *DECODE_ARGS],
                                stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        yield relay, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        relay.close()


def to_address(address: str):
    """A rewrite that puts ``address`` into every Register's worker info."""

    def rewrite(method: str, body: bytes) -> bytes:
        if method != REGISTER:
            return body
        request = ipb.RegisterRequest.FromString(body)
        request.info.rpc_address = address
        return request.SerializeToString()

    return rewrite


def workers(cluster: LocalCluster) -> dict[str, ipb.WorkerInfo]:
    return {w.worker_id: w for w in cluster.workers().workers}


def until(predicate, what: str, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def refusal(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def still_serves(cluster: LocalCluster, reference, salt: int) -> None:
    client = Client(cluster.endpoint)
    try:
        for i in range(3):
            ids = prompt(60, salt + i)
            out = client.generate(Client.request(ids, max_tokens=5))
            assert out.finish_reason == "length", out.error
            assert out.token_ids == engine.generate(reference, ids, 5)
    finally:
        client.close()


def log(cluster: LocalCluster, name: str) -> str:
    return (cluster.log_dir / f"{name}.log").read_text()


def test_a_relay_rewriting_a_signed_register_is_refused(cluster, relayed, reference):
    relay, proc = relayed
    refused = until(lambda: [s for s in relay.seen(REGISTER) if s.code][1:], "the worker never registered", 120)
    assert proc.poll() is None
    for seen in refused:
        assert seen.code == "UNAUTHENTICATED" and seen.details.startswith("body:"), seen.details
    assert EXTRA not in workers(cluster)
    assert "refused /tidekv.v1.Registry/Register from" in log(cluster, "conductor")
    assert {s.method for s in relay.seen()} <= {REGISTER, "/tidekv.v1.Registry/Heartbeat"}, \
        "the Conductor never learned the relay's address: no Prefill or Decode call reached it"
    # The very call the relay received, unaltered, is a valid signature of the worker.
    assert ipb.RegisterResponse.FromString(send(cluster.endpoint, relay.seen(REGISTER)[-1])).accepted
    relay.rewrite = None
    info = until(lambda: workers(cluster).get(EXTRA), f"{EXTRA} is not registered")
    assert info.rpc_address != relay.address
    still_serves(cluster, reference, 100)


def test_a_signed_stats_call_is_refused_by_every_other_worker(cluster, reference):
    infos = workers(cluster)
    relay = Relay(infos["prefill-0"].rpc_address)
    try:
        stats = igrpc.PrefillStub(cluster.channel(relay.address, worker_principal("prefill-0")))
        assert stats.Stats(ipb.StatsRequest(), timeout=5).num_pages_total > 0
        recorded = relay.seen("/Stats")[0]
    finally:
        relay.close()
    code, details = refusal(lambda: send(infos["prefill-1"].rpc_address, recorded))
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("audience:"), details
    assert "'worker/prefill-0'" in details and "'worker/prefill-1'" in details
    code, details = refusal(lambda: send(infos["prefill-0"].rpc_address, recorded))
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("replay:"), details
    assert "refused /tidekv.v1.Prefill/Stats from" in log(cluster, "prefill-1")
    still_serves(cluster, reference, 200)


def test_a_register_replayed_to_a_conductor_restarted_after_sigkill_is_refused(cluster, relayed, reference):
    relay, _ = relayed
    relay.rewrite = None
    told = threading.Event()

    def unknown_once(method: str, body: bytes) -> bytes | None:
        """Tells the worker once that the Conductor does not know it, so it registers again."""
        if method.endswith("/Heartbeat") and not told.is_set():
            told.set()
            return ipb.HeartbeatResponse(known=False).SerializeToString()
        return None

    before = len(relay.seen(REGISTER))
    relay.answer = unknown_once
    accepted: Seen = until(lambda: next((s for s in relay.seen(REGISTER)[before:] if s.code == "OK"), None),
                           "the worker did not register again")
    relay.answer = None
    signed_s = int(dict(accepted.metadata)[AUTH_HEADER].split(".")[1]) / 1000
    cluster.restart_conductor()  # SIGKILL, then a new process on the same port
    age_s = time.time() - signed_s
    code, details = refusal(lambda: send(cluster.endpoint, accepted))
    print(f"\nthe recorded Register was {age_s:.1f} s old when replayed to the restarted Conductor: {details}")
    assert age_s < MAX_SKEW_S, "too slow a restart: the skew limit, not the floor, would refuse the replay"
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("floor:"), details
    until(lambda: EXTRA in workers(cluster), f"{EXTRA} did not register with the new Conductor")
    still_serves(cluster, reference, 300)
