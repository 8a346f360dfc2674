"""Finding 1 of the attacker's probe: the shared store. Two Conductor replicas over the store a
local cluster starts (a real redis-server, AUTH on), attacked as the probe did, by a local
process writing Redis directly:

- without the password it can read and write nothing;
- even with it (an insider with the store's password but not the cluster secret), what it
  plants is ignored: the old index's keys (``SADD tidekv:workers evil``, a worker hash that
  is not JSON, ``tidekv:blk:*`` entries), and records forged into the replicas' log (a
  decode worker's load rewritten to 0 free pages every 20 ms, a worker that does not exist),
  each dropped and logged; every request meanwhile finishes token-exact;
- and nothing it reads tells it which prompt a tenant sent: the block keys of a guessed
  prompt appear nowhere in the store (they are keyed hashes), while the cluster's own keys
  for it do (the scan can see them).
"""

from __future__ import annotations

import threading
import time
import zlib

import pytest
import redis

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from kvstore.blocks import chain_keys
from proto import internal_pb2 as ipb
from proto import state_pb2 as spb
from tests.e2e.conftest import BLOCK, DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt

MAX_TOKENS = 6
NS = "tidekv"


@pytest.fixture(scope="module")
def reference():
    return engine.load_model("tiny")


@pytest.fixture(scope="module")
def cluster():
    config = ClusterConfig(num_prefill=1, num_decode=1, num_conductors=2, policy="round_robin",
                           prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS)
    with LocalCluster(config) as c:
        yield c


def _generate(c: LocalCluster, ids: list[int], tenant: str = "") -> list[int]:
    client = Client(c.endpoints)
    try:
        out = client.generate(Client.request(ids, MAX_TOKENS, tenant=tenant))
    finally:
        client.close()
    assert out.finish_reason == "length", out.error
    return out.token_ids


def test_without_the_password_the_store_answers_nothing(cluster):
    outsider = redis.Redis(host="127.0.0.1", port=cluster.store.port, socket_timeout=2)
    for attempt in (lambda: outsider.exists(f"{NS}:log"), lambda: outsider.sadd(f"{NS}:workers", "evil"),
                    lambda: outsider.xrange(f"{NS}:log", count=1)):
        with pytest.raises(redis.exceptions.AuthenticationError):
            attempt()
    outsider.close()


def test_planted_and_forged_records_are_ignored_and_logged(cluster, reference):
    insider = cluster.store.client()
    # The old index's attack keys: nothing reads them any more.
    insider.sadd(f"{NS}:workers", "evil")
    insider.hset(f"{NS}:worker:evil", "info", "{not json")
    insider.hset(f"{NS}:blk:{'00' * 16}", "evil", "1:1")
    stop = threading.Event()
    num_forged = [0]

    def forge() -> None:  # a decode worker's load rewritten to nothing free, every 20 ms, as the probe did
        load = ipb.WorkerLoad(num_free_pages=0, timestamp_s=time.time() + 1e6)
        beat = spb.StateEntry(wall_s=time.time(), origin="intruder",
                              heartbeat=spb.HeartbeatEntry(worker_id="decode-0", load=load, seq=10**9))
        evil = spb.StateEntry(wall_s=time.time(), origin="intruder",
                              registered=spb.WorkerRecord(info=ipb.WorkerInfo(
                                  worker_id="evil", role=ipb.WORKER_ROLE_DECODE, rpc_address="127.0.0.1:1")))
        while not stop.is_set():
            for fake in (beat, evil):
                seq = insider.incr(f"{NS}:seq")
                insider.xadd(f"{NS}:log", {b"s": str(seq).encode(), b"e": fake.SerializeToString(), b"m": b"\0" * 16})
                num_forged[0] += 1
            stop.wait(0.02)

    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    try:
        for i in range(6):
            ids = prompt(40, 300 + i)
            assert _generate(cluster, ids) == list(engine.generate(reference, ids, MAX_TOKENS))
    finally:
        stop.set()
        thread.join(10)
    assert num_forged[0] > 10
    seen = {w.worker_id for a in cluster.conductor_addresses for w in cluster.workers(a).workers}
    assert seen == {"prefill-0", "decode-0"}
    logs = "".join((cluster.log_dir / f"{cluster.conductor_name(i)}.log").read_text() for i in range(2))
    assert logs.count("MAC does not hold") >= 2  # each forged record dropped, logged once per replica
    insider.close()


def test_the_store_tells_nobody_which_prompt_a_tenant_sent(cluster, reference):
    secret_prompt = prompt(6 * BLOCK, 4242)
    assert _generate(cluster, secret_prompt, tenant="acme") == list(
        engine.generate(reference, secret_prompt, MAX_TOKENS))
    fingerprint = cluster.workers().workers[0].model_fingerprint
    guessed = chain_keys(secret_prompt, BLOCK, fingerprint, "acme")  # what an outsider can compute
    actual = cluster.block_keys(secret_prompt, BLOCK, fingerprint, "acme")
    insider = cluster.store.client()
    until = time.monotonic() + 30
    while True:  # everything the store holds: every key's value, the log's records, the snapshot
        blob = b""
        for key in insider.scan_iter(count=1000):
            kind = insider.type(key)
            if kind == b"stream":
                blob += b"".join(v for _, f in insider.xrange(key) for v in f.values())
            elif kind == b"hash":
                values = insider.hgetall(key).values()
                blob += b"".join(values) + b"".join(_inflate(v) for v in values)
            elif kind == b"string":
                blob += insider.get(key) or b""
        if all(k in blob for k in actual) or time.monotonic() > until:
            break
        time.sleep(0.2)
    insider.close()
    assert all(k in blob for k in actual), "the cluster's own keys must be in the store (the scan works)"
    assert not any(k in blob for k in guessed), "a guessed prompt's keys found in the store"


def _inflate(value: bytes) -> bytes:
    """A snapshot's body (``clusterstate.records``: prefix, MAC, zlib); b"" for anything else."""
    prefix = b"tidekv-snap/1"
    if not value.startswith(prefix):
        return b""
    return zlib.decompress(value[len(prefix) + 16:])
