"""How many routing decisions per second the Conductor core makes, and what forwarding a
stream costs it per token. Prints one JSON object.

``routing``: ``ConductorCore.route`` for a 1,000-block prompt on 8 prefill + 8 decode workers,
through the live ``conductor.cluster.Cluster`` (its registry view reads the index's workers
and loads on every decision, as the live Conductor does) over the memory index and over the
Redis index (a real ``redis-server`` on 127.0.0.1). Every worker holds a prefix of the prompt
of a different depth, and 16 requests are in flight in the pending overlay, so the snapshot
has real work to merge. Two figures per case:

- ``keys_given``: snapshot plus policy plus index match, the block keys computed beforehand
  (the issue's figure; goal: at least 2,000 decisions/s with the memory index), every policy;
- ``with_hashing``: the request as the lifecycle hands it over (token ids), so the chained
  block keys of its 16,000 tokens are computed inside ``route``.

Each case runs ``--rounds`` rounds, the cases of one round in a rotating order so a burst of
load from other processes lands on each alike; ``decisions_per_s`` is the median over rounds
with its min and max, ``median_us``/``p90_us`` are over every decision of every round.

``stream``: the Conductor's per-token path as ``conductor.lifecycle`` runs it for a decode
stream sending one token per message (parse the worker's ``DecodeResponse``,
``ClientStream.more``, ``PendingWork.generated`` with 16 requests in flight, the client's
``GenerateResponse`` serialised), ``PendingWork.generated`` alone, and what the next decision
pays for streams that moved: its overlay view after each of 256 decoding streams got a token.

Usage: python -m bench.conductor [--quick] [--rounds N]
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
from collections.abc import Callable

from kvstore.index_memory import MemoryIndex

from bench.common import summary
from conductor.clock import ManualClock
from conductor.cluster import Cluster
from conductor.config import SLO, SLOTable
from conductor.core import ConductorCore, RequestFacts
from conductor.routing import PolicyContext, RouteDecision, make_policy, policy_names
from costmodel.builtin import tiny_cpu_estimate
from kvstore.blocks import Tier, chain_keys
from kvstore.index import BlockEvent, GlobalIndex
from proto import internal_pb2 as ipb
from runtime.auth import CONDUCTOR, Member, worker_principal

BLOCK, NUM_BLOCKS, NUM_WORKERS, NUM_IN_FLIGHT = 16, 1000, 8, 16
NUM_STREAMS = 256  # decoding at once, for the stream figures
FINGERPRINT = "bench"
PROMPT = tuple((i * 31) % 250 + 1 for i in range(NUM_BLOCKS * BLOCK + 1))  # 1,000 full blocks + 1 token
ROLES = {"prefill": ipb.WORKER_ROLE_PREFILL, "decode": ipb.WORKER_ROLE_DECODE}


def make_cluster(index: GlobalIndex) -> Cluster:
    """A live ``Cluster`` with 8 prefill and 8 decode workers registered (no heartbeats: each
    keeps its initial load, 100,000 free pages)."""
    cluster = Cluster(index, Member(b"bench-secret" * 4, CONDUCTOR))
    for role, wire_role in ROLES.items():
        for i in range(NUM_WORKERS):
            worker_id = f"{role}-{i}"
            info = ipb.WorkerInfo(worker_id=worker_id, role=wire_role, rpc_address=f"127.0.0.1:{6000 + i}",
                                  transfer_address=f"tcp://127.0.0.1:{7000 + i}", model_fingerprint=FINGERPRINT,
                                  block_size=BLOCK, num_pages_total=100_000, instance_id=f"{worker_id:>16}")
            reason = cluster.register(info, worker_principal(worker_id))
            assert reason is None, reason
    return cluster


def seed(cluster: Cluster, keys: tuple[bytes, ...]) -> None:
    """Prefill worker i holds the first (i + 1) / 8 of the prompt, a snapshot every 4 blocks."""
    for i in range(NUM_WORKERS):
        depth = NUM_BLOCKS * (i + 1) // NUM_WORKERS
        cluster.apply_events([BlockEvent.stored(f"prefill-{i}", k, Tier.DRAM, (j + 1) % 4 == 0)
                              for j, k in enumerate(keys[:depth])])


def make_core(cluster: Cluster, policy: str, keys: tuple[bytes, ...]) -> ConductorCore:
    core = ConductorCore(cluster, make_policy(policy, PolicyContext(costs=tiny_cpu_estimate())),
                         SLOTable(SLO(1e9, 1e9)), ManualClock())
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
            core.pending.finish(facts.request_id, 0.0)  # as the lifecycle does at the end; not timed
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


def routing(index: GlobalIndex, policies: list[str], keys: tuple[bytes, ...], rounds: int,
            seconds: float) -> dict[str, dict]:
    cluster = make_cluster(index)
    seed(cluster, keys)
    cases = {f"{policy}/keys_given": Case(make_core(cluster, policy, keys), keys) for policy in policies}
    cases["mooncake/with_hashing"] = Case(make_core(cluster, "mooncake", keys), None)
    out: dict[str, dict] = {}
    for name, result in sorted(run_cases(cases, rounds, seconds).items()):
        policy, kind = name.split("/")
        out.setdefault(policy, {})[kind] = result
    return out


def redis_index(port: int, tmp: str) -> tuple[subprocess.Popen, GlobalIndex]:
    from kvstore.index_redis import RedisIndex, RedisIndexConfig

    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp],
                            stdout=subprocess.DEVNULL)
    for _ in range(100):
        try:
            index = RedisIndex(f"redis://127.0.0.1:{port}", config=RedisIndexConfig(ttl_s=1e6))
            index.workers()
            return proc, index
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


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
    from engine.sampler import SamplingParams
    from engine.tokenizer import CharTokenizer
    from proto import inference_pb2 as pb

    keys = tuple(chain_keys(PROMPT, BLOCK, FINGERPRINT))
    cluster = make_cluster(MemoryIndex(ttl_s=1e9))
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
    # The next decision's share: its overlay view rebuilds the jobs of every decode worker
    # whose streams moved since the last one, here all of NUM_STREAMS streams by one token.
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
    result[f"view_after_{NUM_STREAMS}_streams_moved_us"] = statistics.median(view_s) * 1e6
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short rounds (0.2 s instead of 1 s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per case (default 3)")
    args = p.parse_args()
    seconds = 0.2 if args.quick else 1.0
    keys = tuple(chain_keys(PROMPT, BLOCK, FINGERPRINT))
    out: dict = {"prompt_blocks": NUM_BLOCKS, "workers": f"{NUM_WORKERS} prefill + {NUM_WORKERS} decode",
                 "in_flight": NUM_IN_FLIGHT, "rounds": args.rounds, "round_s": seconds,
                 "goal_memory_decisions_per_s": 2000}
    out["memory"] = routing(MemoryIndex(ttl_s=1e9), policy_names(), keys, args.rounds, seconds)
    for policy, kinds in out["memory"].items():
        print(f"[conductor] memory {policy}: "
              + ", ".join(f"{k} {v['decisions_per_s']:.0f}/s" for k, v in kinds.items()), file=sys.stderr)
    if shutil.which("redis-server"):
        from deploy.local import free_port

        with tempfile.TemporaryDirectory() as tmp:
            proc, index = redis_index(free_port(), tmp)
            try:
                out["redis"] = routing(index, ["mooncake", "cache_aware"], keys, args.rounds, seconds)
            finally:
                index.close()
                proc.terminate()
                proc.wait(timeout=10)
        for policy, kinds in out["redis"].items():
            print(f"[conductor] redis {policy}: "
                  + ", ".join(f"{k} {v['decisions_per_s']:.0f}/s" for k, v in kinds.items()), file=sys.stderr)
    else:
        out["redis"] = {"available": False, "reason": "redis-server not installed"}
    out["stream"] = stream(2000 if args.quick else 10_000, args.rounds)
    print(f"[conductor] stream: {out['stream']['forward_per_token']['median_us']:.1f} us/token", file=sys.stderr)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
