"""Chaos run (CI-sized): a live replay of a window of the Mooncake synthetic trace against a
supervised 2 prefill + 2 decode cluster whose index lives in a real redis-server, during
which one decode worker is SIGKILLed mid-stream, Redis is killed and restarted empty, and one
prefill worker is SIGKILLed while it prefills. Every request must end with exactly one
terminal outcome, every finished answer must equal ``engine.generate``'s token for token, and
the killed workers come back (the supervisor) and leave no cache held anywhere.

The replay's records carry token times, not token ids, so the test keeps each stream's ids
and the decode workers it named through the replay's ``on_message`` hook; the same hook fires
the decode kill from the stream it interrupts, so that kill always lands on in-flight work
(the stream has tokens still to come). Faults are triggered by
progress (requests finished), never by the clock; nothing here asserts how long anything took.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

import engine
import replay.live as live
from deploy.local import ClusterConfig, LocalCluster
from deploy.supervision import RestartPolicy
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from replay.records import FINISHED
from replay.traces import SYNTHETIC_TRACE, read_trace
from replay.transform import ReplayRequest, TraceTransform, apply_transform
from runtime.auth import worker_principal
from tests.e2e.conftest import BLOCK, DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import wait_all_freed

TRACE = SYNTHETIC_TRACE
# The window of the trace with the most reuse inside it (bench/scheduling.py), so pulls and
# local hits run while workers die.
WINDOW_START, NUM_REQUESTS = 3840, 40
MAX_OUTPUT_TOKENS = 48  # streams long enough (milliseconds a token) to be killed mid-stream
MAX_PROMPT_TOKENS = 1024  # bounds the reference's work after the run
# Faults, each once this many requests have finished: decode kill, Redis restart, prefill kill.
DECODE_KILL_AT, REDIS_RESTART_AT, PREFILL_KILL_AT = 6, 14, 22
MIN_TOKENS_LEFT = 16  # the decode kill fires on a stream with at least this many tokens to come
DEADLINE_S = 120.0  # a guard against hangs, never an assertion on how long anything took
OUTAGE_LOG = "the store is unreachable"
RESYNC_LOG = "the store lost its data"


@dataclass
class Capture:
    """What one stream showed: its token ids, the decode workers it named, its terminals."""

    token_ids: list[int] = field(default_factory=list)
    decode_workers: list[str] = field(default_factory=list)
    num_terminal: int = 0
    interrupted: bool = False


@dataclass
class Chaos:
    """The faults and what the streams showed; shared by the sender threads and the test."""

    cluster: LocalCluster
    streams: dict[int, Capture] = field(default_factory=dict)  # by the trace index of each request
    decode_armed: threading.Event = field(default_factory=threading.Event)
    decode_victim: str = ""
    decode_killed: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def num_finished(self) -> int:
        with self.lock:
            return sum(1 for s in self.streams.values() if s.num_terminal)

    def on_message(self, r: ReplayRequest, msg: pb.GenerateResponse) -> None:
        """The replay's hook, on a sender thread after each message: keep the ids and workers;
        kill this stream's decode worker once armed, while it has ``MIN_TOKENS_LEFT`` to come."""
        with self.lock:
            s = self.streams.setdefault(r.index, Capture())
        s.token_ids.extend(msg.token_ids)
        if msg.decode_worker:
            s.decode_workers.append(msg.decode_worker)
        s.num_terminal += bool(msg.finish_reason)
        if not self.decode_armed.is_set() or self.decode_killed.is_set() or not s.decode_workers:
            return
        if len(s.token_ids) >= 3 and r.max_tokens - len(s.token_ids) >= MIN_TOKENS_LEFT:
            with self.lock:
                if self.decode_killed.is_set():
                    return
                self.decode_victim = s.decode_workers[-1]
                s.interrupted = True
                self.cluster.procs[self.decode_victim].kill()  # a crash: the supervisor restarts it
                self.decode_killed.set()


def wait_for(predicate, what: str, timeout_s: float = DEADLINE_S, every_s: float = 0.05):
    until = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < until, f"timed out waiting for {what}"
        time.sleep(every_s)
    return value


def prefill_in_flight(cluster: LocalCluster) -> str:
    """A prefill worker holding a request's cache right now (its name), or ""."""
    for info in cluster.workers().workers:
        if info.role != ipb.WORKER_ROLE_PREFILL:
            continue
        ch = cluster.channel(info.rpc_address, worker_principal(info.worker_id))
        try:
            if igrpc.PrefillStub(ch).Stats(ipb.StatsRequest(), timeout=2).num_live_requests > 0:
                return info.worker_id
        except grpc.RpcError:  # a worker between lives: the next poll asks again
            pass
        finally:
            ch.close()
    return ""


def registered_anew(cluster: LocalCluster, worker_id: str, original: dict[str, str]) -> bool:
    """``worker_id`` is registered from another address than at the start (its new process)."""
    return {w.worker_id: w.rpc_address for w in cluster.workers().workers}.get(worker_id) not in (
        None, original[worker_id])


def window():
    t = TraceTransform(block_size=BLOCK, output_scale=1.0, max_output_tokens=MAX_OUTPUT_TOKENS,
                       max_prompt_tokens=MAX_PROMPT_TOKENS, index_start=WINDOW_START,
                       index_end=WINDOW_START + NUM_REQUESTS, ttft_slo_s=120.0, tbt_slo_s=60.0)
    return apply_transform(read_trace(TRACE), t)


def inject_faults(cluster: LocalCluster, chaos: Chaos, server, original: dict[str, str],
                  replaying: threading.Thread) -> tuple[str, bool]:
    """While the replay runs: the decode kill (fired by a stream), the Redis restart, then the
    prefill kill, each after its number of finished requests. The prefill victim and whether
    it held a request when it died."""
    log = cluster.log_dir / "conductor.log"
    wait_for(lambda: chaos.num_finished() >= DECODE_KILL_AT, "requests before the decode kill")
    chaos.decode_armed.set()
    assert chaos.decode_killed.wait(DEADLINE_S), "no stream was mid-decode after the arming"

    wait_for(lambda: chaos.num_finished() >= REDIS_RESTART_AT, "requests before the Redis restart")
    server.kill()
    wait_for(lambda: OUTAGE_LOG in log.read_text(), "the Conductor to notice the outage")
    server.start()  # the same port, empty

    # One role degraded at a time: the decode victim serves again before a prefill worker dies.
    wait_for(lambda: registered_anew(cluster, chaos.decode_victim, original), "the decode victim back", every_s=0.2)
    wait_for(lambda: chaos.num_finished() >= PREFILL_KILL_AT, "requests before the prefill kill")
    # Poll the prefill workers until one holds a request (a prefill in progress); should the
    # replay end first, prefill-0 is killed idle (and no retry is owed).
    victim = ""
    until = time.monotonic() + 20
    while not victim and replaying.is_alive() and time.monotonic() < until:
        victim = prefill_in_flight(cluster)
        time.sleep(0.005)
    cluster.procs[victim or "prefill-0"].kill()
    return victim or "prefill-0", bool(victim)


def test_chaos_replay_with_worker_kills_and_a_redis_restart(redis_server_factory, reference, tmp_path):
    server = redis_server_factory()
    scaled = window()
    # One request can meet both kills (its first prefill's push to the killed decode worker, its
    # retry on the killed prefill worker): three tries, one more than the faults it can meet.
    config = ClusterConfig(num_prefill=2, num_decode=2, index=f"redis://127.0.0.1:{server.port}",
                           conductor_args=("--max-prefill-attempts", "3"),
                           prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS, supervise=True,
                           restart_policy=RestartPolicy(initial_backoff_s=0.5), data_dir=str(tmp_path / "cluster"))
    t0 = time.monotonic()
    with LocalCluster(config) as cluster:
        chaos = Chaos(cluster)
        original = {w.worker_id: w.rpc_address for w in cluster.workers().workers}
        result: list[live.LiveResult] = []
        runner = threading.Thread(target=lambda: result.append(live.run_live_replay(
            scaled, cluster.endpoint, max_concurrency=16, timeout_s=DEADLINE_S, progress=False,
            on_message=chaos.on_message)), name="replay")
        runner.start()
        try:
            prefill_victim, prefill_had_work = inject_faults(cluster, chaos, server, original, runner)
        finally:
            runner.join(DEADLINE_S * 2)
        assert not runner.is_alive() and result, "the replay did not end"
        records = result[0].records
        replay_s = time.monotonic() - t0

        # Both victims were restarted by the supervisor and registered again from new addresses.
        for victim in (chaos.decode_victim, prefill_victim):
            wait_for(lambda v=victim: any(e.kind == "restarted" and e.name == v for e in cluster.events),
                     f"{victim} to be restarted")
            wait_for(lambda v=victim: registered_anew(cluster, v, original), f"{victim} to register again",
                     every_s=0.2)
        wait_for(lambda: RESYNC_LOG in (cluster.log_dir / "conductor.log").read_text(),
                 "the Conductor's resync after the Redis restart")
        migrations = cluster.conductor_counter("decode_migrations")
        retries = cluster.conductor_counter("prefill_retries")
        crashed = sorted(e.name for e in cluster.events if e.kind == "crashed")
        stats = wait_all_freed(cluster)
        assert all(p.poll() is None for p in cluster.procs.values()), cluster.events

    outcomes = Counter(r.outcome for r in records)
    print(f"\nchaos: {len(records)} requests in {replay_s:.1f}s, outcomes {dict(outcomes)}; killed "
          f"{chaos.decode_victim} mid-stream and {prefill_victim} ({'prefilling' if prefill_had_work else 'idle'}); "
          f"decode migrations {migrations:g}, prefill retries {retries:g}; crashes {crashed}")

    # Exactly one record per request, none missing, none twice; none lost, none wrong.
    assert len(records) == NUM_REQUESTS == len({r.index for r in records})
    assert sorted(r.index for r in records) == [r.index for r in scaled.requests]
    bad = [(r.request_id, r.outcome, r.status, r.error) for r in records if r.outcome != FINISHED]
    assert not bad, bad  # two workers of each role, one killed at a time: there was always a live one
    prompts = {r.index: r for r in scaled.requests}
    for r in records:
        s = chaos.streams[r.index]
        assert s.num_terminal == 1 and r.finish_reason == "length", r
        assert len(s.token_ids) == r.num_output_tokens == r.max_tokens, r
        want = prompts[r.index]
        assert s.token_ids == engine.generate(reference, list(want.prompt_ids), want.max_tokens), r.request_id

    # The interrupted stream went on on the other decode worker, counted as a migration.
    [cut] = [s for s in chaos.streams.values() if s.interrupted]
    assert cut.decode_workers[0] == chaos.decode_victim and cut.decode_workers[-1] != chaos.decode_victim
    assert migrations >= 1 and migrations + retries >= 1
    assert crashed == sorted([chaos.decode_victim, prefill_victim])  # nothing else died
    for name, s in stats.items():
        assert s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total, (name, s)
