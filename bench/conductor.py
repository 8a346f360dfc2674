"""How many routing decisions per second the Conductor core makes, embedded and as one of
several replicas over a shared state; how fast the replicas' log carries changes; how a burst
split over replicas spreads; and what forwarding a stream costs per token. Prints one JSON
object.

``routing``: ``ConductorCore.route`` for a 1,000-block prompt on 8 prefill + 8 decode workers,
through the live ``conductor.cluster.Cluster`` (its registry view reads the workers and loads
on every decision, as the live Conductor does), ``embedded`` (one Conductor, its state in
memory) and ``replica`` (a Conductor whose state follows the log in a real ``redis-server``
on 127.0.0.1 that a second replica also follows and writes to, its decisions shared with it).
Every worker holds a prefix of the prompt of a different depth, and 16 requests are in flight
in the pending overlay, so the snapshot has real work to merge. Two figures per case:

- ``keys_given``: snapshot plus policy plus index match, the block keys computed beforehand
  (goal: at least 2,000 decisions/s per replica with mooncake, and at least 0.8x embedded);
- ``with_hashing``: the request as the lifecycle hands it over (token ids), so the chained
  block keys of its 16,000 tokens are computed inside ``route``.

``live`` (a real local cluster: 2 Conductor replicas, 3 prefill and 1 decode worker, the
store started by the cluster): a burst of 24 requests with distinct prompts, sent all to one
replica and then split over both, and the spread of their prefill workers (max / min requests
per worker; goal: split within 1.5x of one replica's); then each replica's log delay (an
entry's time from its writer to being applied there) p50 and p99 over that traffic.

Each case runs ``--rounds`` rounds, the cases of one round in a rotating order so a burst of
load from other processes lands on each alike; ``decisions_per_s`` is the median over rounds
with its min and max, ``median_us``/``p90_us`` are over every decision of every round.

``stream``: the Conductor's per-token path as ``conductor.lifecycle`` runs it for a decode
stream sending one token per message (parse the worker's ``DecodeResponse``,
``ClientStream.more``, ``PendingWork.generated`` with 16 requests in flight, the client's
``GenerateResponse`` serialised), ``PendingWork.generated`` alone, and what the next decision
pays for streams that moved: its overlay view after each of 256 decoding streams got a token.

Usage: python -m bench.conductor [--quick] [--rounds N] [--no-live]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import redis

from bench.common import summary
from clusterstate.log import EntryApplier, entry
from clusterstate.records import StoreKeys
from clusterstate.redis_log import RedisLog, RedisLogConfig
from clusterstate.state import ClusterState
from conductor.clock import ManualClock
from conductor.cluster import Cluster
from conductor.config import SLO, SLOTable
from conductor.core import ConductorCore, RequestFacts
from conductor.routing import PolicyContext, RouteDecision, make_policy, policy_names
from costmodel.builtin import tiny_cpu_estimate
from kvstore.blocks import Tier, chain_keys
from kvstore.index import BlockEvent
from proto import internal_pb2 as ipb
from runtime.auth import CONDUCTOR, Member, worker_principal

BLOCK, NUM_BLOCKS, NUM_WORKERS, NUM_IN_FLIGHT = 16, 1000, 8, 16
NUM_STREAMS = 256  # decoding at once, for the stream figures
FINGERPRINT = "bench"
PROMPT = tuple((i * 31) % 250 + 1 for i in range(NUM_BLOCKS * BLOCK + 1))  # 1,000 full blocks + 1 token
ROLES = {"prefill": ipb.WORKER_ROLE_PREFILL, "decode": ipb.WORKER_ROLE_DECODE}


SECRET = b"bench-secret" * 6


def embedded_cluster() -> Cluster:
    return Cluster.in_memory(Member(SECRET, CONDUCTOR), ttl_s=1e9)


def replica_cluster(url: str, namespace: str) -> tuple[Cluster, RedisLog]:
    """A Conductor replica's ``Cluster``, its state following the log at ``url`` (started)."""
    state, keys = ClusterState(ttl_s=1e9), StoreKeys.from_secret(SECRET)
    log_ = RedisLog(lambda: redis.Redis.from_url(url, socket_timeout=2), EntryApplier(state, keys), keys,
                    f"bench-{len(namespace)}-{time.monotonic_ns()}", RedisLogConfig(namespace=namespace))
    log_.start()
    while not log_.ready:
        time.sleep(0.01)
    return Cluster(state, log_, Member(SECRET, CONDUCTOR), keys), log_


def register_workers(cluster: Cluster) -> Cluster:
    """8 prefill and 8 decode workers registered (no heartbeats: each keeps its initial
    load, 100,000 free pages)."""
    for role, wire_role in ROLES.items():
        for i in range(NUM_WORKERS):
            worker_id = f"{role}-{i}"
            info = ipb.WorkerInfo(worker_id=worker_id, role=wire_role, rpc_address=f"127.0.0.1:{6000 + i}",
                                  transfer_address=f"tcp://127.0.0.1:{7000 + i}", model_fingerprint=FINGERPRINT,
                                  block_size=BLOCK, num_pages_total=100_000, instance_id=f"{worker_id:>16}")
            reason = cluster.register(info, worker_principal(worker_id))
            assert reason is None, reason
    return cluster


def make_cluster() -> Cluster:
    return register_workers(embedded_cluster())


def seed(cluster: Cluster, keys: tuple[bytes, ...]) -> None:
    """Prefill worker i holds the first (i + 1) / 8 of the prompt, a snapshot every 4 blocks."""
    for i in range(NUM_WORKERS):
        depth = NUM_BLOCKS * (i + 1) // NUM_WORKERS
        cluster.apply_events([BlockEvent.stored(f"prefill-{i}", k, Tier.DRAM, (j + 1) % 4 == 0)
                              for j, k in enumerate(keys[:depth])])


def make_core(cluster: Cluster, policy: str, keys: tuple[bytes, ...]) -> ConductorCore:
    share = None
    if cluster.log.shared:  # a replica: every decision goes to the other replicas' overlays
        origin = cluster.log.replica_id
        share = lambda change: cluster.log.share(entry(origin, pending=change))  # noqa: E731
    core = ConductorCore(cluster, make_policy(policy, PolicyContext(costs=tiny_cpu_estimate())),
                         SLOTable(SLO(1e9, 1e9)), ManualClock(), share=share)
    for i in range(NUM_IN_FLIGHT):  # requests in flight: the overlay has work to merge
        core.route(RequestFacts(f"inflight-{i}", i, (), 8, "", block_keys=keys, num_prompt_tokens=NUM_BLOCKS * BLOCK))
    return core


class Case:
    """One (index, policy, keys given or not) measurement, run a round at a time."""

    def __init__(self, core: ConductorCore, keys: tuple[bytes, ...] | None):
        self.core, self.keys = core, keys
        self.seq = NUM_IN_FLIGHT
        self.rates: list[float] = []
        self.samples: list[float] = []

    def round(self, seconds: float) -> None:
        samples, core = [], self.core
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            prompt = () if self.keys is not None else PROMPT
            facts = RequestFacts(f"r{self.seq}", self.seq, prompt, 8, "", block_keys=self.keys,
                                 num_prompt_tokens=len(PROMPT))
            t0 = time.perf_counter()
            out = core.route(facts)
            samples.append(time.perf_counter() - t0)
            core.finished(facts.request_id)  # as the lifecycle does at the end; not timed
            assert isinstance(out.outcome, RouteDecision), out.outcome
            self.seq += 1
        self.rates.append(len(samples) / sum(samples))
        self.samples += samples

    def result(self) -> dict:
        s = summary(self.samples)
        return {"decisions_per_s": statistics.median(self.rates), "min_per_s": min(self.rates),
                "max_per_s": max(self.rates), "median_us": s["median_s"] * 1e6, "p90_us": s["p90_s"] * 1e6,
                "n": s["n"]}


def run_cases(cases: dict[str, Case], rounds: int, seconds: float) -> dict[str, dict]:
    names = list(cases)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            cases[name].round(seconds)
    return {name: case.result() for name, case in cases.items()}


def routing(cluster: Cluster, policies: list[str], keys: tuple[bytes, ...], rounds: int,
            seconds: float) -> dict[str, dict]:
    seed(cluster, keys)
    cases = {f"{policy}/keys_given": Case(make_core(cluster, policy, keys), keys) for policy in policies}
    cases["mooncake/with_hashing"] = Case(make_core(cluster, "mooncake", keys), None)
    out: dict[str, dict] = {}
    for name, result in sorted(run_cases(cases, rounds, seconds).items()):
        policy, kind = name.split("/")
        out.setdefault(policy, {})[kind] = result
    return out


def redis_server(port: int, tmp: str) -> subprocess.Popen:
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp],
                            stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=1)
    for _ in range(200):
        try:
            client.ping()
            return proc
        except redis.exceptions.RedisError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def shared_routing(policies: list[str], keys: tuple[bytes, ...], rounds: int, seconds: float) -> dict:
    """``routing`` on a replica of two over a real Redis (the other one follows too)."""
    from deploy.local import free_port

    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc = redis_server(port, tmp)
        url = f"redis://127.0.0.1:{port}"
        try:
            cluster, log_ = replica_cluster(url, "bench")
            other, other_log = replica_cluster(url, "bench")
            shared_seen = Counter()
            other_log.applier.on_overlay = lambda e: shared_seen.update([e.WhichOneof("change")])
            try:
                register_workers(cluster)
                out = routing(cluster, policies, keys, rounds, seconds)
                deadline = time.monotonic() + 30
                while other_log.seq < log_.seq and time.monotonic() < deadline:
                    time.sleep(0.01)
                out["other_replica_same_state"] = other.state.digest() == cluster.state.digest()
                out["other_replica_received"] = dict(shared_seen)  # the decisions shared with it
                return out
            finally:
                log_.close()
                other_log.close()
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def live(num_burst: int = 24) -> dict:
    """The burst's spread on 2 replicas against 1, and each replica's log delays (see the docstring)."""
    from conductor.client import Client
    from deploy.local import ClusterConfig, LocalCluster

    config = ClusterConfig(num_prefill=3, num_decode=1, num_conductors=2, policy="mooncake",
                           prefill_args=("--block-size", "16", "--num-pages", "512"),
                           decode_args=("--block-size", "16", "--num-pages", "2048"))
    with LocalCluster(config) as cluster:
        clients = [Client(a) for a in cluster.conductor_addresses]
        try:
            rounds = []
            for r in range(3):  # alternating, a fresh set of prompts each time
                one = burst(clients[:1], config.num_prefill, num_burst, 1000 * r)
                two = burst(clients, config.num_prefill, num_burst, 1000 * r + 500)
                rounds.append({"one_replica": one, "two_replicas": two})
                time.sleep(1.0)  # let the workers' queues drain and heartbeats settle
            delays = log_delays(cluster)
        finally:
            for c in clients:
                c.close()
    spreads = [(x["one_replica"]["spread"], x["two_replicas"]["spread"]) for x in rounds]
    return {"burst_rounds": rounds,
            "burst_median_spread": {"one_replica": statistics.median(a for a, _ in spreads),
                                    "two_replicas": statistics.median(b for _, b in spreads)},
            "burst_goal": "two_replicas spread within 1.5x of one_replica's",
            "log_delay": delays}


def burst(clients: list, num_prefill: int, num_burst: int, salt: int) -> dict:
    """``num_burst`` distinct prompts at once, dealt round-robin over ``clients``' Conductors:
    how many each prefill worker got, and the largest over the smallest count."""
    from conductor.client import Client

    prompts = [[(i * 131 + (salt + j) * 7919) % 250 + 1 for i in range(192)] for j in range(num_burst)]
    with ThreadPoolExecutor(num_burst) as pool:
        outs = list(pool.map(lambda j: clients[j % len(clients)].generate(Client.request(prompts[j], 2)),
                             range(num_burst)))
    counts = Counter(o.prefill_worker for o in outs)
    per_worker = [counts.get(f"prefill-{i}", 0) for i in range(num_prefill)]
    return {"per_prefill_worker": per_worker,
            "spread": max(per_worker) / min(per_worker) if min(per_worker) else float("inf"),
            "all_finished": all(o.finish_reason == "length" for o in outs)}


def log_delays(cluster) -> dict:
    """Each replica's delay from an entry's append to its application (State RPC)."""
    from proto import internal_pb2_grpc as igrpc

    delays = {}
    for address in cluster.conductor_addresses:
        ch = cluster.channel(address)
        try:
            st = igrpc.RegistryStub(ch).State(ipb.StateRequest(), timeout=5)
            delays[address] = {"p50_ms": st.delay_p50_s * 1e3, "p99_ms": st.delay_p99_s * 1e3,
                               "entries": st.num_delays, "seq": st.seq}
        finally:
            ch.close()
    return delays


def _per_call_us(fn: Callable[[int], object], num_calls: int, repeats: int) -> dict:
    """Median (and min, max) over ``repeats`` of the mean time of ``fn(i)`` for ``num_calls`` i."""
    means = []
    for r in range(repeats):
        t0 = time.perf_counter()
        for i in range(r * num_calls, (r + 1) * num_calls):
            fn(i)
        means.append((time.perf_counter() - t0) / num_calls * 1e6)
    return {"median_us": statistics.median(means), "min_us": min(means), "max_us": max(means)}


def stream(num_tokens: int, repeats: int) -> dict:
    """Per-token cost of forwarding a decode stream, one token a message (see the docstring)."""
    from conductor.client_stream import ClientStream
    from conductor.metrics import ConductorMetrics
    from conductor.validation import ValidRequest
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import CharTokenizer
    from proto import inference_pb2 as pb

    keys = tuple(chain_keys(PROMPT, BLOCK, FINGERPRINT))
    cluster = make_cluster()
    core = make_core(cluster, "mooncake", keys)
    pending, clock = core.pending, core.clock
    for i in range(NUM_IN_FLIGHT):
        pending.prefill_done(f"inflight-{i}", clock.now())
        pending.decode_started(f"inflight-{i}", clock.now())
    req = ValidRequest(PROMPT[:32], SamplingParams(max_new_tokens=1 << 20), 300.0, "")
    out = ClientStream("inflight-0", req, CharTokenizer(259), ConductorMetrics.disabled(), core.slos, clock)
    wire = [ipb.DecodeResponse(token_ids=[40 + i % 80]).SerializeToString() for i in range(num_tokens)]

    def forward(i: int) -> None:  # lifecycle._forward -> _more, for one message
        msg = ipb.DecodeResponse.FromString(wire[i % num_tokens])
        sent: pb.GenerateResponse = out.more(tuple(msg.token_ids))
        pending.generated("inflight-0", len(out.tokens))
        sent.SerializeToString()

    forward(0)
    result = {"forward_per_token": _per_call_us(forward, num_tokens, repeats),
              "pending_generated_per_token": _per_call_us(lambda i: pending.generated("inflight-1", i + 1),
                                                          num_tokens, repeats)}
    result[f"view_after_{NUM_STREAMS}_streams_moved_us"] = _view_after_streams_moved(core, keys, repeats)
    return result


def _view_after_streams_moved(core: ConductorCore, keys: tuple[bytes, ...], repeats: int) -> float:
    """The next decision's share of a stream's cost: its overlay view rebuilds the jobs of
    every decode worker whose streams moved since the last one, here all of NUM_STREAMS
    streams by one token (median microseconds)."""
    pending, clock = core.pending, core.clock
    for i in range(NUM_STREAMS):
        routed = core.route(RequestFacts(f"s{i}", NUM_IN_FLIGHT + i, (), 500, "", block_keys=keys[:8],
                                         num_prompt_tokens=8 * BLOCK + 1))
        assert isinstance(routed.outcome, RouteDecision), routed.outcome
        pending.prefill_done(f"s{i}", clock.now())
        pending.decode_started(f"s{i}", clock.now())

    def view_after_every_stream_moved(step: int) -> None:
        for i in range(NUM_STREAMS):
            pending.generated(f"s{i}", step + 1)
        t0 = time.perf_counter()
        pending.view()
        view_s.append(time.perf_counter() - t0)

    view_s: list[float] = []
    _per_call_us(view_after_every_stream_moved, 100, repeats)
    return statistics.median(view_s) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short rounds (0.2 s instead of 1 s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per case (default 3)")
    p.add_argument("--no-live", action="store_true", help="skip the live cluster's burst and log delays")
    args = p.parse_args()
    seconds = 0.2 if args.quick else 1.0
    keys = tuple(chain_keys(PROMPT, BLOCK, FINGERPRINT))
    out: dict = {"prompt_blocks": NUM_BLOCKS, "workers": f"{NUM_WORKERS} prefill + {NUM_WORKERS} decode",
                 "in_flight": NUM_IN_FLIGHT, "rounds": args.rounds, "round_s": seconds,
                 "goal_replica_mooncake_decisions_per_s": 2000, "goal_replica_over_embedded": 0.8}
    out["embedded"] = routing(make_cluster(), policy_names(), keys, args.rounds, seconds)
    for policy, kinds in out["embedded"].items():
        print(f"[conductor] embedded {policy}: "
              + ", ".join(f"{k} {v['decisions_per_s']:.0f}/s" for k, v in kinds.items()), file=sys.stderr)
    if shutil.which("redis-server"):
        out["replica"] = shared_routing(["mooncake", "cache_aware"], keys, args.rounds, seconds)
        for policy in ("mooncake", "cache_aware"):
            kinds = out["replica"][policy]
            print(f"[conductor] replica {policy}: "
                  + ", ".join(f"{k} {v['decisions_per_s']:.0f}/s" for k, v in kinds.items()), file=sys.stderr)
        out["replica_over_embedded"] = {
            policy: {k: out["replica"][policy][k]["decisions_per_s"] / out["embedded"][policy][k]["decisions_per_s"]
                     for k in out["replica"][policy]} for policy in ("mooncake", "cache_aware")}
        if not args.no_live:
            out["live"] = live()
            print(f"[conductor] burst spread: {out['live']['burst_median_spread']}", file=sys.stderr)
    else:
        out["replica"] = {"available": False, "reason": "redis-server not installed"}
    out["stream"] = stream(2000 if args.quick else 10_000, args.rounds)
    print(f"[conductor] stream: {out['stream']['forward_per_token']['median_us']:.1f} us/token", file=sys.stderr)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
