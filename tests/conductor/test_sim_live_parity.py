"""The simulator and the live Conductor share the core's bookkeeping, step by step.

A simulation of 40 requests (3 prefill + 2 decode workers, shared prefixes, tenants; cold,
local and pull decisions and rejections; three policies) is recorded at the core's seams:
each routing decision with its request, each transition (``prefilled``, ``decoding``,
``generated``, ``finished``), each heartbeat and each batch of block events, with the
pending overlay after every transition. The same sequence then drives the live side:
``conductor.cluster.Cluster`` fed the same registrations, heartbeats (as wire messages) and
block events, and one real ``RequestLife`` per request over a dispatcher that answers each
call only when the recording reaches the simulator's answer. Every live decision must equal
the simulator's, and the live pending overlay must equal the simulator's after every step."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from conductor.clock import ManualClock
from conductor.cluster import Cluster
from conductor.config import ConductorConfig
from conductor.core import ConductorCore
from conductor.dispatch import DecodeChunk, PrefillCall, PrefillResult
from conductor.lifecycle import Refused, RequestLife
from conductor.routing import PolicyContext, make_policy
from conductor.validation import ValidRequest
from costmodel import CostModels
from decode_worker.config import DecodeConfig
from engine.sampler import SamplingParams
from engine.tokenizer import CharTokenizer
from kvstore.index import BlockEvent
from prefill_worker.config import PrefillConfig
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb
from proto.convert import load_to_proto
from replay.sim.cluster import FINGERPRINT
from replay.sim.run import SimConfig, Simulation
from replay.transform import ReplayRequest, ScaledTrace, TraceTransform
from runtime.auth import CONDUCTOR, Member, worker_principal

BS = 16
COSTS = CostModels.analytic(prefill_s_per_token=1e-3, decode_base_s=0.01, decode_s_per_request=1e-3)
TRANSITIONS = ("route", "prefilled", "decoding", "generated", "finished")
SECRET = b"sim-live-parity" * 4


def trace(num_requests: int = 40) -> ScaledTrace:
    """Prompts over 4 shared prefixes of 2-12 blocks, two tenants, 1-12 output tokens, arriving
    faster than the workers serve them (so queues, the overlay and pulls matter), some with a
    TTFT SLO too tight to meet behind a queue."""
    prefixes = [[(p * 7919 + i * 31) % 250 + 1 for i in range(BS * (2 + 3 * p))] for p in range(4)]
    requests = []
    for i in range(num_requests):
        prefix = prefixes[(i * 3) % 4]
        tail = [(i * 131 + j * 17) % 250 + 1 for j in range(5 + (i * 37) % 40)]
        prompt = tuple(prefix + tail)
        requests.append(ReplayRequest(f"t{i}", i, 0.02 * i, len(prompt), 1 + (i * 5) % 12, prompt_ids=prompt,
                                      tenant="acme" if i % 5 == 4 else "",
                                      ttft_slo_s=0.05 if i % 7 == 6 else None))  # some are refused
    return ScaledTrace(TraceTransform(block_size=BS), tuple(requests), "parity", "inline", num_requests, 0.0, 0, 0)


@dataclass
class Step:
    kind: str  # a transition, or "beat" / "blocks"
    t: float
    args: tuple
    pending: object = None  # the overlay after a transition
    outcome: object = None  # route: the decision or rejection


def record(sim: Simulation) -> list[Step]:
    """Runs ``sim``, recording what crossed the core's seams (see the module docstring)."""
    steps: list[Step] = []
    core, cluster, now = sim.core, sim.cluster, lambda: sim.loop.now

    def transition(name: str):
        original = getattr(core, name)

        def recorded(*args, **kwargs):
            result = original(*args, **kwargs)
            step = Step(name, now(), args, core.pending.view())
            if name == "route":
                step.outcome = result.outcome
            steps.append(step)
            return result
        return recorded

    for name in TRANSITIONS:
        setattr(core, name, transition(name))
    apply = cluster.index.apply_store_events

    def applied(worker_id, events, at_s=None):  # a prefill worker's store changes, as a live one publishes them
        steps.append(Step("blocks", now(), (tuple(BlockEvent.removed(worker_id, e.key) if e.kind == "removed" else
                                                  BlockEvent.stored(worker_id, e.key, e.tier, e.has_snapshot)
                                                  for e in events),)))
        return apply(worker_id, events, at_s)

    cluster.index.apply_store_events = applied
    beat = cluster._beat

    def beaten(worker):
        beat(worker)
        steps.append(Step("beat", now(), (worker.worker_id, cluster._loads[worker.worker_id])))

    cluster._beat = beaten
    sim.run()
    return steps


@dataclass
class Gate:
    """Where one request's live call waits for the recording: ``answers`` are handed to it one
    at a time; ``waiting`` is set while it waits (or once it ended)."""

    answers: list = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    waiting: bool = False
    done: bool = False

    def wait_for_answer(self):
        with self.cond:
            self.waiting = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.answers)
            self.waiting = False
            return self.answers.pop(0)

    def answer(self, value) -> None:
        with self.cond:
            self.answers.append(value)
            self.cond.notify_all()
            # The request runs until it waits for its next answer (or ends): nothing else moves meanwhile.
            assert self.cond.wait_for(lambda: self.waiting and not self.answers, timeout=10), "live request stuck"

    def ended(self) -> None:
        with self.cond:
            self.waiting = self.done = True
            self.cond.notify_all()


class RecordedDispatcher:
    """Answers each request's prefill and decode when the driver passes on the simulator's."""

    def __init__(self):
        self.gates: dict[str, Gate] = {}

    def reserve(self, decode_worker: str, request_id: str, num_prompt_tokens: int, max_tokens: int,
                deadline_s: float) -> str:
        return f"tcp://{decode_worker}"

    def prefill(self, prefill_worker: str, call: PrefillCall, on_cancel) -> PrefillResult:
        worker_s, queue_s = self.gates[call.placement_id.split("/")[0]].wait_for_answer()
        return PrefillResult(65, 0, worker_s, queue_s=queue_s)

    def decode(self, decode_worker: str, request_id: str, first_token: int, sampling: SamplingParams,
               num_prompt_tokens: int, deadline_s: float, on_cancel) -> Iterator[DecodeChunk]:
        gate, sent = self.gates[request_id.split("/")[0]], 1
        while True:
            answer = gate.wait_for_answer()
            if answer == "finish":
                yield DecodeChunk((), pb.FINISH_REASON_LENGTH)
                return
            yield DecodeChunk((66,) * (answer - sent))
            sent = answer

    def release(self, decode_worker: str, request_id: str) -> None:
        pass


class LiveSide:
    """The live Conductor's cluster, core and one ``RequestLife`` thread per request."""

    def __init__(self, sim: Simulation, config: ConductorConfig):
        self.clock = ManualClock()
        self.cluster = Cluster.in_memory(Member(SECRET, CONDUCTOR), ttl_s=1e9, clock=self.clock.wall)
        policy = make_policy(config.policy, PolicyContext(config.routing, COSTS))
        self.core = ConductorCore(self.cluster, policy, config.slos, self.clock)
        self.dispatcher = RecordedDispatcher()
        self.requests = {r.request_id: r for r in sim.scaled.requests}
        self.threads: list[threading.Thread] = []
        self.routed: dict[str, object] = {}
        self.refused: dict[str, Refused] = {}
        self._seq = 0
        for entry in sim.cluster.registry_view(sim.loop.clock.wall()):
            info = entry.info
            role = ipb.WORKER_ROLE_PREFILL if info.role.name == "PREFILL" else ipb.WORKER_ROLE_DECODE
            wire = ipb.WorkerInfo(worker_id=info.worker_id, role=role, rpc_address=info.rpc_address,
                                  transfer_address=info.transfer_address, model_fingerprint=FINGERPRINT,
                                  block_size=BS, num_pages_total=info.num_pages_total,
                                  instance_id=f"{info.worker_id:>16}")
            assert self.cluster.register(wire, worker_principal(info.worker_id)) is None
            self.beat(info.worker_id, entry.load)
        route = self.core.route

        def recorded_route(facts, avoid=()):
            routed = route(facts, avoid)
            self.routed[facts.request_id] = routed.outcome
            return routed
        self.core.route = recorded_route

    def at(self, t: float) -> None:
        self.clock.advance(t - self.clock.now())

    def beat(self, worker_id: str, load) -> None:
        self._seq += 1
        assert self.cluster.heartbeat(worker_id, load_to_proto(load), [], self._seq)

    def start(self, request_id: str, seq: int) -> None:
        r = self.requests[request_id]
        gate = self.dispatcher.gates[request_id] = Gate()
        valid = ValidRequest(r.prompt_ids, SamplingParams(max_new_tokens=r.max_tokens), 1e9, r.tenant,
                             r.ttft_slo_s or 0.0)
        life = RequestLife(self.core, self.dispatcher, CharTokenizer(259), valid, request_id, seq, 1)

        def run() -> None:
            try:
                for _ in life.run():
                    pass
            except Refused as e:
                self.refused[request_id] = e
            finally:
                gate.ended()

        thread = threading.Thread(target=run, name=request_id, daemon=True)
        self.threads.append(thread)
        with gate.cond:
            thread.start()
            assert gate.cond.wait_for(lambda: gate.waiting, timeout=10), f"{request_id} never routed"


@pytest.mark.parametrize("policy", ["mooncake", "kv_cost", "cache_aware"])
def test_the_simulator_and_the_live_lifecycle_decide_and_account_alike(policy: str) -> None:
    config = ConductorConfig(policy=policy, heartbeat_interval_s=0.25)
    sim = Simulation(trace(), SimConfig(num_prefill=3, num_decode=2, conductor=config,
                                        prefill=PrefillConfig(block_size=BS, num_pages=4096),
                                        decode=DecodeConfig(block_size=BS, num_pages=1 << 16)), COSTS)
    live = LiveSide(sim, config)
    steps = record(sim)
    seqs = {r.request_id: life_seq for life_seq, r in enumerate(sim.scaled.requests)}
    kinds = [s.kind for s in steps]
    assert kinds.count("route") == 40 and kinds.count("prefilled") >= 30 and kinds.count("generated") >= 30
    branches = {s.outcome.branch.value for s in steps if s.kind == "route" and hasattr(s.outcome, "branch")}
    if policy == "mooncake":
        assert {"cold", "local", "pull"} <= branches, branches
        assert any(s.kind == "route" and not hasattr(s.outcome, "branch") for s in steps)  # some rejected

    num_compared = 0
    routed_at: dict[str, float] = {}
    for i, step in enumerate(steps):
        live.at(step.t)
        if step.kind == "beat":
            live.beat(*step.args)
            continue
        if step.kind == "blocks":
            live.cluster.apply_events(step.args[0])
            continue
        rid = step.args[0].request_id if step.kind == "route" else step.args[0]
        gate = live.dispatcher.gates.get(rid)
        if step.kind == "route":
            routed_at[rid] = step.t
            live.start(rid, seqs[rid])
            assert live.routed[rid] == step.outcome, f"step {i}: {rid} decided differently"
        elif step.kind == "prefilled":
            # The worker's time for it and its wait for the engine (the simulator's dispatch is
            # 0), as a Prefill response carries them. The live request goes on at once to its
            # batch (decoding) or, with one token, to its end (finished): compared at the
            # simulator's next step for it.
            gate.answer((step.args[3], step.t - routed_at[rid] - step.args[3]))
            continue
        elif step.kind == "generated":
            gate.answer(step.args[1])
        elif step.kind == "finished" and not gate.done:
            gate.answer("finish")
        assert live.core.pending.view() == step.pending, f"step {i} ({step.kind} {rid}): overlays differ"
        num_compared += 1
    for thread in live.threads:
        thread.join(10)
        assert not thread.is_alive()
    assert live.core.pending.view() == [s.pending for s in steps if s.pending is not None][-1]
    assert num_compared > 100
    assert set(live.refused) == {s.args[0].request_id for s in steps
                                 if s.kind == "route" and not hasattr(s.outcome, "branch")}
