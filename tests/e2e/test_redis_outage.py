"""Redis outage while serving (end to end): a real redis-server holding the cluster's log is
SIGKILLed under load and restarted empty on the same port. Every request still finishes
token-exact, prefixes the Conductor knows keep being reused during the outage (it routes on
its own state and keeps the log entries meanwhile), and after the restart the Conductor puts
its state back into the store: a replica started afterwards finds the workers and their
blocks, including those stored only while Redis was down."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

import engine
from clusterstate.log import EntryApplier
from clusterstate.records import StoreKeys
from clusterstate.redis_log import RedisLog
from clusterstate.state import ClusterState
from conductor.client import Client, Completion
from deploy.local import ClusterConfig, LocalCluster
from runtime.auth import load_secret
from tests.e2e.conftest import BLOCK, DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt, wait_all_freed

NAMESPACE = "tidekv"  # the store namespace the Conductor uses by default
NUM_CLIENTS = 3
NUM_PER_PHASE = 2  # requests each client finishes wholly inside each phase
MAX_TOKENS = 4
DEADLINE_S = 120.0  # a guard against hangs, never an assertion on how long anything took
OUTAGE_LOG = "the store is unreachable"
RESYNC_LOG = "the store lost its data"
PHASES = ("before", "outage", "after")


@dataclass
class Sent:
    client: int
    ids: list[int]
    phase_at_start: str
    phase_at_end: str = ""
    out: Completion | None = None
    error: str = ""


@dataclass
class Load:
    """``NUM_CLIENTS`` threads sending greedy requests back to back until ``stop``; each
    client's prompts share a 128-token prefix, so most of them reuse cached blocks."""

    endpoint: str
    phase: str = PHASES[0]
    sent: list[Sent] = field(default_factory=list)
    num_in_flight: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client, args=(i,), name=f"load-{i}") for i in range(NUM_CLIENTS)]
        for t in threads:
            t.start()
        return threads

    def _client(self, i: int) -> None:
        client, family = Client(self.endpoint), prompt(128, 960 + i)
        try:
            k = 0
            while not self.stop.is_set():
                with self.changed:
                    sent = Sent(i, family + prompt(20 + k % 7, 1000 * i + k), self.phase)
                    self.sent.append(sent)
                    self.num_in_flight += 1
                try:
                    sent.out = client.generate(Client.request(sent.ids, max_tokens=MAX_TOKENS), timeout_s=DEADLINE_S)
                except Exception as e:  # noqa: BLE001 - recorded, and the test asserts there is none
                    sent.error = f"{type(e).__name__}: {e}"
                with self.changed:
                    sent.phase_at_end = self.phase
                    self.num_in_flight -= 1
                    self.changed.notify_all()
                k += 1
        finally:
            client.close()

    def set_phase(self, phase: str) -> None:
        with self.changed:
            self.phase = phase

    def wait(self, predicate: Callable[[], bool], what: str) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, DEADLINE_S), f"load: {what} ({len(self.sent)} sent)"

    def num_done_within(self, phase: str) -> int:
        """The fewest requests any client started and ended inside ``phase``."""
        per_client = [0] * NUM_CLIENTS
        for sent in self.sent:
            if sent.phase_at_start == sent.phase_at_end == phase:
                per_client[sent.client] += 1
        return min(per_client)


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    until = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < until, f"timed out waiting for {what}"
        time.sleep(0.05)


def generate(cluster: LocalCluster, ids: list[int]) -> Completion:
    client = Client(cluster.endpoint)
    try:
        return client.generate(Client.request(ids, max_tokens=MAX_TOKENS), timeout_s=DEADLINE_S)
    finally:
        client.close()


def conductor_log(cluster: LocalCluster) -> str:
    return (cluster.data_dir / "logs" / "conductor.log").read_text()


def test_redis_killed_and_restarted_empty_under_load(redis_server_factory, reference):
    server = redis_server_factory()
    config = ClusterConfig(num_prefill=2, num_decode=1, index=f"redis://127.0.0.1:{server.port}",
                           prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS)
    with LocalCluster(config) as cluster:
        workers = cluster.workers().workers
        worker_ids = sorted(w.worker_id for w in workers)
        assert worker_ids == ["decode-0", "prefill-0", "prefill-1"]
        base = prompt(200, 950)  # cached before the outage, asked for during and after it
        first = generate(cluster, base)
        assert first.cached_tokens == 0 and first.error == ""
        load = Load(cluster.endpoint)
        threads = load.start()
        extra: list[tuple[list[int], Completion]] = [(base, first)]
        try:
            load.wait(lambda: load.num_done_within("before") >= NUM_PER_PHASE, "requests before the outage")
            load.wait(lambda: load.num_in_flight > 0, "a request in flight")
            server.kill()
            load.set_phase("outage")
            wait_for(lambda: OUTAGE_LOG in conductor_log(cluster), "the Conductor to notice the outage")
            during = base[:176] + prompt(30, 951)
            extra.append((during, generate(cluster, during)))
            load.wait(lambda: load.num_done_within("outage") >= NUM_PER_PHASE, "requests during the outage")

            server.start()  # the same port, empty: the worst case
            load.set_phase("after")
            wait_for(lambda: RESYNC_LOG in conductor_log(cluster), "the Conductor's resync")
            load.wait(lambda: load.num_done_within("after") >= NUM_PER_PHASE, "requests after the restart")
            after = base[:144] + prompt(40, 952)
            extra.append((after, generate(cluster, after)))
        finally:
            load.stop.set()
            for t in threads:
                t.join(DEADLINE_S)
        assert not any(t.is_alive() for t in threads)

        # The store holds the cluster again: a replica started now catches up to the workers,
        # the prefix cached before the outage, and the blocks stored only while it was down.
        fingerprint = workers[0].model_fingerprint
        keys = StoreKeys.from_secret(load_secret(str(cluster.secret_file)))
        state = ClusterState(ttl_s=30.0)
        view = RedisLog(lambda: redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5),
                        EntryApplier(state, keys), keys, "test-replica")
        view.start()
        try:
            wait_for(lambda: view.ready and len(state.workers()) == 3, "a new replica to find the cluster")
            base_match = state.match(cluster.block_keys(base, BLOCK, fingerprint))
            best = max(base_match.matches, key=lambda m: m.num_blocks_usable)
            during_keys, during_out = cluster.block_keys(extra[1][0], BLOCK, fingerprint), extra[1][1]
            during_match = state.match(during_keys).get(during_out.prefill_worker)
        finally:
            view.close()
        assert sorted(w.worker_id for w, _ in state.workers()) == worker_ids
        assert best.num_blocks_usable >= 144 // BLOCK, best
        assert during_match is not None and during_match.num_blocks_present == len(during_keys), during_match

        log = conductor_log(cluster)
        assert log.count(OUTAGE_LOG) == 1 and log.count(RESYNC_LOG) == 1, log[-4000:]
        stats = wait_all_freed(cluster)

    # Every request finished exactly once, token-exact; some were in flight when Redis died.
    sent = load.sent
    assert {s.phase_at_start for s in sent} == set(PHASES)
    assert any(s.phase_at_start == "before" and s.phase_at_end != "before" for s in sent)
    for s in sent:
        assert s.error == "" and s.out is not None, s.error
    completions = [(s.ids, s.out) for s in sent] + extra
    for ids, out in completions:
        assert out.num_terminal == 1 and out.finish_reason == "length", out.error
        assert out.token_ids == engine.generate(reference, ids, MAX_TOKENS)
    # The outage served repeated prefixes from the Conductor's local view, and after the
    # restart a prefix cached before the outage was found again.
    assert extra[1][1].cached_tokens > 0
    assert any(s.out.cached_tokens > 0 for s in sent if s.phase_at_start == s.phase_at_end == "outage")
    assert extra[2][1].cached_tokens > 0
    for name, s in stats.items():
        assert s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total, name
