"""Conductor replicas over one shared cluster state, on real processes: three Conductors, two
prefill and two decode workers, the HTTP front and a real redis-server (AUTH on). Workers
register once, through one replica, and every replica serves them token-exactly; a replica
SIGKILLed mid-stream (twice, restarted by the supervisor each time) loses no request, for
gRPC clients and for the OpenAI client through the HTTP front alike: every stream is resumed
on another replica and finishes token-exact.

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
LONG_TOKENS = 64  # through the HTTP front: long streams, so that a kill lands mid-stream
HTTP_REQUESTS = 36  # the second kill after 25 have started: 11 and those in flight see it
KILLS = 2
DEADLINE_S = 240.0  # a guard against hangs


@pytest.fixture(scope="module")
def replicas():
    # A killed replica's reservations are freed by the prefill worker's ABORT; one killed
    # between a Reserve and its Prefill call (or the prefill's answer and Decode) goes after the
    # TTL, as the replica renews nothing any more. Live replicas renew theirs, so a short TTL
    # does not cut a placement's prefill queue short on a loaded host.
    config = ClusterConfig(num_prefill=2, num_decode=2, num_conductors=3, policy="round_robin",
                           prefill_args=WORKER_ARGS, decode_args=(*DECODE_ARGS, "--reservation-ttl-s", "10"),
                           supervise=True, http_port=0,
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
    stats = wait_all_freed(replicas, timeout_s=60)
    assert all(s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total for s in stats.values()), stats


def _up(cluster: LocalCluster, name: str, min_restarts: int) -> bool:
    """Whether ``name`` was restarted and serves again (its restarts counted over the test)."""
    restarted = sum(1 for e in cluster.events if e.name == name and e.kind == "restarted")
    state = next((s for s in cluster.state().processes if s.name == name), None)
    return restarted >= min_restarts and state is not None and state.status == "up"


def test_a_replay_through_the_http_front_survives_two_replica_kills(replicas, reference):
    import openai

    from observe.top import scrape

    tok = reference.tokenizer
    client = openai.OpenAI(base_url=replicas.http_url, api_key="unused", max_retries=0, timeout=DEADLINE_S)
    requests = [prompt(40 + i % 24, 900 + i) for i in range(HTTP_REQUESTS)]
    expected = [_reference(reference, ids, LONG_TOKENS) for ids in requests]
    started = threading.Semaphore(0)

    def send(ids: list[int]) -> tuple[str, list[int], str | None]:
        started.release()
        text, got, finish = "", [], None
        for chunk in client.completions.create(model="tiny", prompt=ids, max_tokens=LONG_TOKENS, temperature=0,
                                               stream=True):
            for choice in chunk.choices:
                text += choice.text or ""
                got += choice.token_ids
                finish = choice.finish_reason or finish
        return text, got, finish

    def failovers() -> dict[str, float]:
        return {dict(labels)["kind"]: value for name, labels, value in scrape(f"127.0.0.1:{replicas.http_port}",
                                                                        timeout_s=10)
                if name == "tidekv:http_conductor_failovers_total"}

    before = failovers()

    def killer() -> None:
        for k, victim in enumerate(("conductor", "conductor-1")):  # the front starts on the first
            for _ in range(10 + 15 * k):
                started.acquire(timeout=DEADLINE_S)
            replicas.kill(victim, restart=True)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(send, requests))
    thread.join(timeout=60)
    after = failovers()
    wrong = [i for i, ((text, got, finish), want) in enumerate(zip(outs, expected, strict=True))
             if got != want or text != tok.decode(want) or finish != "length"]
    assert not wrong, [(i, outs[i][2]) for i in wrong]
    resumed = after.get("resumed", 0) - before.get("resumed", 0)
    retried = after.get("retried", 0) - before.get("retried", 0)
    print(f"\n{HTTP_REQUESTS} streams through the HTTP front, 2 replicas killed: {resumed:.0f} resumed mid-stream, "
          f"{retried:.0f} retried before their first token")
    assert resumed + retried >= 2
