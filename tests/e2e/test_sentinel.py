"""A Redis primary failover under Sentinel while two Conductor replicas serve (end to end, real
redis-server and redis-sentinel processes, AUTH on): the primary is SIGKILLed under load, the
sentinels promote its replica, no request fails, every answer is token-exact, and afterwards
both Conductors hold exactly the same block sets."""

from __future__ import annotations

import threading
import time

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt

MAX_TOKENS = 4
NUM_CLIENTS = 3
DEADLINE_S = 120.0  # a guard against hangs


def _states(cluster: LocalCluster) -> list[ipb.StateResponse]:
    out = []
    for address in cluster.conductor_addresses:
        ch = cluster.channel(address)
        try:
            out.append(igrpc.RegistryStub(ch).State(ipb.StateRequest(), timeout=5))
        finally:
            ch.close()
    return out


def test_a_primary_failover_under_sentinel_loses_no_request_and_the_replicas_converge(
        sentinels, tmp_path, reference):
    password_file = tmp_path / "store.password"
    password_file.write_text(sentinels.password + "\n")
    password_file.chmod(0o600)
    config = ClusterConfig(num_prefill=2, num_decode=1, num_conductors=2, index=sentinels.url,
                           index_password_file=str(password_file), prefill_args=WORKER_ARGS,
                           decode_args=DECODE_ARGS)
    results: list[tuple[list[int], object]] = []
    errors: list[str] = []
    stop, lock = threading.Event(), threading.Lock()
    with LocalCluster(config) as cluster:

        def client_loop(i: int) -> None:
            client, family = Client(cluster.endpoints), prompt(96, 700 + i)
            k = 0
            try:
                while not stop.is_set():
                    ids = family + prompt(16 + k % 5, 7000 * i + k)
                    try:
                        out = client.generate(Client.request(ids, MAX_TOKENS), timeout_s=DEADLINE_S)
                    except Exception as e:  # noqa: BLE001 - recorded; the test asserts there is none
                        with lock:
                            errors.append(f"{type(e).__name__}: {e}")
                    else:
                        with lock:
                            results.append((ids, out))
                    k += 1
            finally:
                client.close()

        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(NUM_CLIENTS)]
        for t in threads:
            t.start()
        try:
            _wait(lambda: len(results) >= 6, "requests before the failover")
            old = sentinels.primary_port()
            sentinels.primary.kill()
            _wait(lambda: sentinels.primary_port() == sentinels.replica.port, "the sentinels to promote the replica")
            after = len(results)
            _wait(lambda: len(results) >= after + 9, "requests after the failover")
        finally:
            stop.set()
            for t in threads:
                t.join(DEADLINE_S)
        assert old != sentinels.replica.port
        _wait(lambda: len({s.blocks_digest for s in _states(cluster)}) == 1, "the replicas to converge")
        states = _states(cluster)
        logs = "".join((cluster.log_dir / f"{cluster.conductor_name(i)}.log").read_text() for i in range(2))
    assert not errors, errors
    for ids, out in results:
        assert out.finish_reason == "length" and out.num_terminal == 1, out.error
        assert out.token_ids == list(engine.generate(reference, ids, MAX_TOKENS))
    assert states[0].num_blocks > 0 and states[0].blocks_digest == states[1].blocks_digest
    assert all(s.shared for s in states)
    print(f"\n{len(results)} requests; the store failed over from :{old} to :{sentinels.replica.port}; "
          f"both replicas hold {states[0].num_blocks} blocks (seq {states[0].seq} / {states[1].seq}); "
          f"the Conductors noticed it {logs.count('the store is unreachable')} times")


def _wait(predicate, what: str) -> None:
    until = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < until, f"timed out waiting for {what}"
        time.sleep(0.1)
