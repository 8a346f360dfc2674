"""Conductor replicas over one shared cluster state, on real processes: three Conductors, two
prefill and two decode workers and a real redis-server (AUTH on). Workers register once,
through one replica, and every replica serves them token-exactly; a replica SIGKILLed
mid-stream (twice, restarted by the supervisor each time) loses no request: every stream
is resumed on another replica and finishes token-exact.

The assertions are on what each request received, never on how long anything took."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt, wait_all_freed

NUM_REQUESTS = 60
MAX_TOKENS = 24
KILLS = 2
DEADLINE_S = 240.0  # a guard against hangs


@pytest.fixture(scope="module")
def replicas():
    config = ClusterConfig(num_prefill=2, num_decode=2, num_conductors=3, policy="round_robin",
                           prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS, supervise=True,
                           conductor_args=("--decode-stall-timeout-s", "10"))
    with LocalCluster(config) as cluster:
        yield cluster


def _reference(model, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return list(engine.generate(model, ids, max_new_tokens=max_tokens))


def test_workers_registered_once_are_served_by_every_replica(replicas, reference):
    # Workers were given every address and registered with the first that answered.
    logs = {i: (replicas.log_dir / f"{replicas.conductor_name(i)}.log").read_text() for i in range(3)}
    assert all(f"registered prefill prefill-{i}" in logs[0] for i in range(2))
    assert not any("registered prefill" in logs[i] or "registered decode" in logs[i] for i in (1, 2))
    for address in replicas.conductor_addresses:
        seen = sorted(w.worker_id for w in replicas.workers(address).workers)
        assert seen == ["decode-0", "decode-1", "prefill-0", "prefill-1"], (address, seen)
        client = Client(address)
        try:
            for salt in range(2):
                ids = prompt(40, salt + 100 * replicas.conductor_addresses.index(address))
                out = client.generate(Client.request(ids, MAX_TOKENS))
                assert out.finish_reason == "length" and out.num_terminal == 1
                assert out.token_ids == _reference(reference, ids)
        finally:
            client.close()


def test_a_replica_killed_mid_stream_twice_loses_no_request(replicas, reference):
    client = Client(replicas.endpoints)
    # Requests start on the replica the client picks; killing the one it currently uses
    # guarantees streams in flight there.
    requests = [prompt(48 + i % 16, 500 + i) for i in range(NUM_REQUESTS)]
    expected = [_reference(reference, ids) for ids in requests]
    started, done = threading.Semaphore(0), threading.Event()
    kills: list[str] = []

    def send(ids: list[int]):
        started.release()
        return client.generate(Client.request(ids, MAX_TOKENS), timeout_s=DEADLINE_S)

    def killer() -> None:
        for k in range(KILLS):
            for _ in range(10 + 15 * k):  # some requests in flight first
                started.acquire(timeout=DEADLINE_S)
            victim = replicas.conductor_name(replicas.conductor_addresses.index(client.endpoints[client._current]))
            kills.append(victim)
            replicas.kill(victim, restart=True)  # a crash: the supervisor starts it again
            until = time.monotonic() + DEADLINE_S
            while not done.is_set() and not _up(replicas, victim, k + 1):
                assert time.monotonic() < until
                time.sleep(0.2)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(send, requests))
    finally:
        done.set()
        thread.join(timeout=60)
        client.close()
    failed = [(i, o.finish_reason, o.error) for i, o in enumerate(outs) if o.finish_reason != "length"]
    assert not failed, failed
    wrong = [i for i, (o, e) in enumerate(zip(outs, expected, strict=True)) if o.token_ids != e]
    assert not wrong, wrong
    assert all(o.num_terminal == 1 for o in outs)
    print(f"\n{NUM_REQUESTS} requests, replicas killed: {kills}; calls failed over: {client.num_failovers}, "
          f"streams resumed mid-way: {client.num_resumed}")
    assert len(kills) == KILLS and client.num_failovers >= KILLS
    restarts = [e for e in replicas.events if e.name in kills and e.kind == "restarted"]
    assert len(restarts) == KILLS, [e.report for e in replicas.events]
    stats = wait_all_freed(replicas)
    assert all(s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total for s in stats.values()), stats


def _up(cluster: LocalCluster, name: str, min_restarts: int) -> bool:
    """Whether ``name`` was restarted and serves again (its restarts counted over the test)."""
    restarted = sum(1 for e in cluster.events if e.name == name and e.kind == "restarted")
    state = next((s for s in cluster.state().processes if s.name == name), None)
    return restarted >= min_restarts and state is not None and state.status == "up"
