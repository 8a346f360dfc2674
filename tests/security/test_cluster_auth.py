"""The attacks of issue 11, tried against a real cluster (Conductor + 2 prefill + 1 decode
processes on loopback) by a process on the same host: without the cluster secret, and as a
member that holds it but is not the Conductor or the worker instance it claims to be.
Each must be refused with a clear status and a log line, and the cluster must go on serving
token-exact answers from its real workers."""

from __future__ import annotations

import time

import grpc
import pytest

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.auth import CONDUCTOR, OPERATOR, Member, grant, sign, worker_principal
from runtime.grpc_server import channel
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt

UNAUTH, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def cluster():
    config = ClusterConfig(num_prefill=2, num_decode=1, policy="round_robin", prefill_args=WORKER_ARGS,
                           decode_args=DECODE_ARGS)
    with LocalCluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    return engine.load_model("tiny")


def secret(cluster: LocalCluster) -> bytes:
    return cluster.secret_file.read_text().strip().encode()


def workers(cluster: LocalCluster) -> dict[str, ipb.WorkerInfo]:
    return {w.worker_id: w for w in cluster.workers().workers}


def code_of(call, *args, **kwargs) -> grpc.StatusCode:
    """The status ``call(*args, **kwargs)`` fails with (it must fail)."""
    with pytest.raises(grpc.RpcError) as e:
        call(*args, **kwargs)
    return e.value.code()


def still_serves(cluster: LocalCluster, reference, salt: int) -> None:
    """Token-exact answers, each from one of the real workers."""
    client = Client(cluster.endpoint)
    try:
        for i in range(3):
            ids = prompt(60, salt + i)
            out = client.generate(Client.request(ids, max_tokens=5))
            assert out.finish_reason == "length", out.error
            assert out.token_ids == engine.generate(reference, ids, 5)
            assert out.prefill_worker in ("prefill-0", "prefill-1") and out.decode_worker == "decode-0"
    finally:
        client.close()


def log(cluster: LocalCluster, name: str) -> str:
    return (cluster.data_dir / "logs" / f"{name}.log").read_text()


def test_registry_needs_the_cluster_secret(cluster, reference):
    real = workers(cluster)["decode-0"]
    hijack = ipb.WorkerInfo()
    hijack.CopyFrom(real)
    hijack.rpc_address, hijack.instance_id = "127.0.0.1:9", "f" * 32
    stub = igrpc.RegistryStub(channel(cluster.endpoint))
    assert code_of(lambda: stub.Register(ipb.RegisterRequest(info=hijack), timeout=5)) == UNAUTH
    assert code_of(lambda: stub.Workers(ipb.WorkersRequest(), timeout=5)) == UNAUTH
    assert code_of(lambda: stub.Heartbeat(ipb.HeartbeatRequest(worker_id="decode-0"), timeout=5)) == UNAUTH
    wrong = Member(b"0" * 64, worker_principal("decode-0")).channel(cluster.endpoint, audience=CONDUCTOR)
    assert code_of(lambda: igrpc.RegistryStub(wrong).Register(ipb.RegisterRequest(info=hijack), timeout=5)) == UNAUTH
    assert "refused /tidekv.v1.Registry/Register from" in log(cluster, "conductor")
    still_serves(cluster, reference, 100)


def test_a_member_cannot_take_a_live_workers_id(cluster, reference):
    """With the secret but not the instance: Register of a live id is refused and logged with
    both addresses; its heartbeats (signed with the secret, not the session key) are refused;
    it cannot register for an id other than its own principal's."""
    real = workers(cluster)["prefill-0"]
    hijack = ipb.WorkerInfo()
    hijack.CopyFrom(real)
    hijack.rpc_address, hijack.instance_id = "127.0.0.1:9", "e" * 32
    member = Member(secret(cluster), worker_principal("prefill-0")).channel(cluster.endpoint, audience=CONDUCTOR)
    resp = igrpc.RegistryStub(member).Register(ipb.RegisterRequest(info=hijack), timeout=5)
    assert not resp.accepted and "alive" in resp.reason and real.rpc_address in resp.reason
    assert (f"refused Register of worker prefill-0 from 127.0.0.1:9: that id is alive at {real.rpc_address}"
            in log(cluster, "conductor"))
    beat = ipb.HeartbeatRequest(worker_id="prefill-0", load=ipb.WorkerLoad(num_free_pages=10**6))
    assert code_of(lambda: igrpc.RegistryStub(member).Heartbeat(beat, timeout=5)) == UNAUTH
    other = Member(secret(cluster), worker_principal("mallory")).channel(cluster.endpoint, audience=CONDUCTOR)
    resp = igrpc.RegistryStub(other).Register(ipb.RegisterRequest(info=hijack), timeout=5)
    assert not resp.accepted and "may not register worker prefill-0" in resp.reason
    assert workers(cluster)["prefill-0"].rpc_address == real.rpc_address
    assert not any(w.instance_id for w in cluster.workers().workers), "Workers must not reveal instance ids"
    still_serves(cluster, reference, 200)


def test_only_the_conductor_drives_workers(cluster, reference):
    infos = workers(cluster)
    decode_addr, prefill_addr = infos["decode-0"].rpc_address, infos["prefill-0"].rpc_address
    reserve = ipb.ReserveRequest(request_id="stolen", prompt_tokens=1, max_tokens=10**5)
    prefill = ipb.PrefillRequest(request_id="forged", token_ids=[1, 2, 3],
                                 sampling=pb.SamplingParams(max_tokens=1), decode_transfer_address="tcp://127.0.0.1:9")
    callers = {"nobody": lambda address, audience: channel(address),
               "operator": Member(secret(cluster), OPERATOR).channel,
               "conductor signing with the secret": Member(secret(cluster), CONDUCTOR).channel}
    for who, dial in callers.items():
        decode = igrpc.DecodeStub(dial(decode_addr, audience=worker_principal("decode-0")))
        prefill_stub = igrpc.PrefillStub(dial(prefill_addr, audience=worker_principal("prefill-0")))
        want = DENIED if who == "operator" else UNAUTH
        assert code_of(decode.Reserve, reserve, timeout=5) == want, who
        assert code_of(decode.Release, ipb.ReleaseRequest(request_id="x"), timeout=5) == want, who
        assert code_of(lambda d: list(d.Decode(ipb.DecodeRequest(request_id="x"), timeout=5)), decode) == want, who
        assert code_of(prefill_stub.Prefill, prefill, timeout=5) == want, who
    decode_stats = igrpc.DecodeStub(cluster.channel(decode_addr, worker_principal("decode-0")))
    stats = decode_stats.Stats(ipb.StatsRequest(), timeout=5)
    assert stats.num_free_pages == stats.num_pages_total  # the refused Reserve took nothing
    assert "refused /tidekv.v1.Decode/Reserve from" in log(cluster, "decode-0")
    still_serves(cluster, reference, 300)


def test_push_blocks_needs_the_conductors_grant(cluster, reference):
    """A member that asks a holder for blocks it was not routed to gets PERMISSION_DENIED:
    without a grant, with a forged one, and with a real-looking grant for other blocks."""
    ids = prompt(200, 400)
    client = Client(cluster.endpoint)
    out = client.generate(Client.request(ids, max_tokens=2))
    client.close()
    holder = workers(cluster)[out.prefill_worker]
    member = Member(secret(cluster), worker_principal("mallory"))
    stub = igrpc.PrefillStub(member.channel(holder.rpc_address, audience=worker_principal(holder.worker_id)))
    keys = [b"k" * 32]
    base = dict(transfer_id="t", block_keys=keys, dest_transfer_address="tcp://127.0.0.1:9", request_id="r")
    forged, expiry = grant(b"x" * 32, "r", "mallory", "tcp://127.0.0.1:9", keys, 30)
    for extra in ({}, {"grant": forged, "grant_expiry_ms": expiry}):
        req = ipb.PushBlocksRequest(**base, **extra)
        assert code_of(stub.PushBlocks, req, timeout=5) == DENIED
    bare = igrpc.PrefillStub(channel(holder.rpc_address))
    assert code_of(lambda: bare.PushBlocks(ipb.PushBlocksRequest(**base), timeout=5)) == UNAUTH
    assert "refused PushBlocks of 1 blocks by mallory" in log(cluster, out.prefill_worker)
    still_serves(cluster, reference, 500)


def test_a_recorded_credential_cannot_be_replayed(cluster):
    body = ipb.WorkersRequest().SerializeToString()
    metadata = sign(secret(cluster), OPERATOR, "/tidekv.v1.Registry/Workers", CONDUCTOR, body)
    stub = igrpc.RegistryStub(channel(cluster.endpoint))
    assert stub.Workers(ipb.WorkersRequest(), metadata=metadata, timeout=5).workers
    assert code_of(lambda: stub.Workers(ipb.WorkersRequest(), metadata=metadata, timeout=5)) == UNAUTH
    stale = sign(secret(cluster), OPERATOR, "/tidekv.v1.Registry/Workers", CONDUCTOR, body, now_s=time.time() - 600)
    assert code_of(lambda: stub.Workers(ipb.WorkersRequest(), metadata=stale, timeout=5)) == UNAUTH
    other_method = sign(secret(cluster), OPERATOR, "/tidekv.v1.Registry/Register", CONDUCTOR, body)
    assert code_of(lambda: stub.Workers(ipb.WorkersRequest(), metadata=other_method, timeout=5)) == UNAUTH
