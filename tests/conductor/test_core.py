"""The Conductor core without gRPC: the snapshot builder's merge of heartbeats and the
pending overlay, a burst spreading within one heartbeat, the retry rule, and the config."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest

from clusterstate.state import ClusterState
from clusterstate.workers import PrefillJobLoad, WorkerInfo, WorkerLoad, WorkerRole
from conductor.clock import ManualClock
from conductor.config import SLO, ConductorConfig, SLOTable, parse_tenant_slos
from conductor.core import ConductorCore, RequestFacts
from conductor.dispatch import FailureKind, should_retry
from conductor.pending import PendingView, PendingWork
from conductor.routing import (
    PolicyContext,
    Rejection,
    ReusePlan,
    RouteDecision,
    RouteRequest,
    make_policy,
    policy_names,
)
from conductor.snapshot import RegistryEntry, ViewMemo, build_snapshot
from conductor.speed import Pace, WorkerSpeed
from costmodel import CostModels
from runtime.settings import parse_config

BS = 16
COSTS = CostModels.analytic(prefill_s_per_token=1e-3, decode_base_s=0.01, decode_s_per_request=1e-3)


class StaticCluster:
    """A ClusterView whose registry never changes (no heartbeats arrive during the test)."""

    model_fingerprint = "fp"
    block_size = BS

    def __init__(self, entries: tuple[RegistryEntry, ...]):
        self.entries = entries
        self.index = ClusterState(ttl_s=1e9)
        for e in entries:
            self.index.register(e.info)

    def registry_view(self, wall_now_s: float) -> tuple[RegistryEntry, ...]:
        return self.entries

    def match(self, keys):
        return self.index.match(keys) if keys else None

    def apply_events(self, events) -> None:
        self.index.apply(events)


def entry(worker_id: str, role: str, load: WorkerLoad | None = None, age_s: float = 0.0) -> RegistryEntry:
    info = WorkerInfo(worker_id, WorkerRole(role), f"rpc-{worker_id}", 1000, transfer_address=f"tcp://{worker_id}")
    return RegistryEntry(info, load or WorkerLoad(num_free_pages=1000), age_s)


def facts(i: int, n: int = 200) -> RequestFacts:
    return RequestFacts(f"r{i}", i, tuple((i * 7919 + t) % 250 + 1 for t in range(n)), 8, "")


# --- the snapshot merge ------------------------------------------------------------------------


def _routed(core: ConductorCore, i: int) -> RouteDecision:
    out = core.route(facts(i)).outcome
    assert isinstance(out, RouteDecision), out
    return out


def test_a_burst_within_one_heartbeat_spreads_as_predicted_queues_grow() -> None:
    clock = ManualClock()
    cluster = StaticCluster((entry("p0", "prefill"), entry("p1", "prefill"), entry("p2", "prefill"),
                             entry("d0", "decode")))
    core = ConductorCore(cluster, make_policy("mooncake", PolicyContext(costs=COSTS)), SLOTable(SLO(60, 1)), clock)
    picks = [_routed(core, i).prefill_worker for i in range(9)]  # no time passes, no heartbeat comes
    assert Counter(picks) == {"p0": 3, "p1": 3, "p2": 3}
    predicted = [_routed(core, i).predicted.queue_s for i in range(9, 12)]
    assert predicted == pytest.approx([0.6, 0.6, 0.6])  # 3 cold 200-token prefills queued on each


def test_without_the_overlay_the_same_burst_herds_onto_one_worker() -> None:
    registry = (entry("p0", "prefill"), entry("p1", "prefill"), entry("d0", "decode"))
    policy = make_policy("mooncake", PolicyContext(costs=COSTS))
    picks = set()
    for i in range(4):
        snapshot = build_snapshot(registry, None, PendingView(), 0.0)  # the stale heartbeat alone
        out = policy(snapshot, RouteRequest(f"r{i}", i, 200, 12, 8, BS))
        picks.add(out.prefill_worker)
    assert picks == {"p0"}


def test_heartbeat_jobs_and_own_pending_are_each_counted_once() -> None:
    pending = PendingWork()
    def route(rid: str, prefill: str, decode: str, now: float) -> None:
        req = RouteRequest(rid, 0, 100, 6, 20, BS)
        pending.route(req, RouteDecision(prefill, decode, ReusePlan(2, None)), now)

    route("seen", "p", "d", 0.0)  # the heartbeat lists it
    route("new", "p", "d", 0.1)  # routed after the heartbeat
    route("gone", "p", "d", 0.0)
    pending.finish("gone", 0.2)  # finished after the heartbeat
    load_p = WorkerLoad(prefill_jobs=(PrefillJobLoad("seen", 68, 32, 0.25), PrefillJobLoad("gone", 68, 32),
                                      PrefillJobLoad("other", 50)))
    load_d = WorkerLoad(num_free_pages=100, num_queued=2, request_ids=("seen", "gone"))
    snap = build_snapshot((entry("p", "prefill", load_p, age_s=0.5), entry("d", "decode", load_d)), None,
                          pending.view(), 1.0)
    jobs = {j.request_id: j for j in snap.prefill[0].prefill_jobs}
    assert set(jobs) == {"seen", "other", "new"}
    assert jobs["seen"].elapsed_s == pytest.approx(0.75)  # advanced by the heartbeat's age
    assert jobs["new"] == PrefillJobLoad("new", 68, 32, 0.0)
    d = snap.decode[0]
    need = math.ceil((100 + 20) / BS)
    # "new" takes its pages (not listed yet); "gone" gives its back (listed, but finished)
    assert d.num_free_pages == 100 - need + need and d.num_queued == 2 - 1 + 1
    assert {j.request_id for j in d.decode_jobs} == {"seen", "new"}
    assert not any(j.decoding for j in d.decode_jobs)  # both still in prefill
    for view in snap.prefill + snap.decode:  # built without __init__, equal to a checked one
        assert dataclasses.replace(view) == view


def test_a_worker_not_seen_yet_runs_at_the_pooled_pace_of_those_seen() -> None:
    """A worker that joins a cluster running at about twice the calibrated time is predicted
    at that pace, not at the calibration's, until its own first prefill; and that first
    sample moves its factor from the pooled one, not from 1."""
    speed = WorkerSpeed(weight=0.5)
    registry = [entry("p0", "prefill"), entry("p1", "prefill"), entry("new", "prefill"), entry("d0", "decode")]

    def views():
        return {v.worker_id: v for v in build_snapshot(registry, None, PendingView(), 0.0, 0.0, speed.paces(),
                                                        ViewMemo()).prefill}

    assert views()["new"].slowdown == 1.0 and speed.paces().unseen == Pace()  # nothing seen: the calibration
    speed.observe("p0", calibrated_s=1.0, observed_s=2.2, handoff_s=0.2, dispatch_s=0.01)
    speed.observe("p1", calibrated_s=1.0, observed_s=3.0, handoff_s=0.4, dispatch_s=0.03)
    paces = speed.paces()
    unseen = paces.unseen  # the lower middle of p0's and p1's
    assert unseen == Pace(paces["p0"].slowdown, 0.2, 0.01) and unseen.slowdown > 1.5
    new = views()["new"]
    assert (new.slowdown, new.handoff_s, new.dispatch_s) == (unseen.slowdown, 0.2, 0.01)
    assert views()["p1"].slowdown == paces["p1"].slowdown  # a seen worker keeps its own
    speed.observe("new", calibrated_s=1.0, observed_s=1.0)  # its first prefill, at the calibrated speed
    assert speed.paces()["new"].slowdown == pytest.approx((0.5 * 0.5 * unseen.slowdown + 1.0) / (0.5 * 0.5 + 1.0))


def test_a_retry_routed_back_while_the_heartbeat_lists_the_placement_that_left() -> None:
    """The chaos replay's case: r0 left p0 (its prefill failed) and was routed to p0 again, and
    p0's heartbeat still lists the placement that left. No job counts (the listed one left, the
    new one is hidden behind it): the snapshot holds none, and does not fail on the empty list."""
    pending = PendingWork()
    req = RouteRequest("r0", 0, 100, 6, 20, BS)
    decision = RouteDecision("p0", "d0", ReusePlan(0, None))
    pending.route(req, decision, 0.0)
    pending.finish("r0", 0.1)  # routed again: its work leaves both workers
    pending.route(req, decision, 0.2)
    listed = WorkerLoad(prefill_jobs=(PrefillJobLoad("r0", 100, 0, 0.0),))
    registry = [entry("p0", "prefill", listed), entry("d0", "decode")]
    snapshot = build_snapshot(registry, None, pending.view(), 0.5, 0.0, {}, ViewMemo())
    assert snapshot.prefill[0].prefill_jobs == ()


def test_a_rejection_is_not_recorded_as_pending() -> None:
    clock = ManualClock()
    cluster = StaticCluster((entry("p0", "prefill"), entry("d0", "decode")))
    core = ConductorCore(cluster, make_policy("mooncake", PolicyContext(costs=COSTS)), SLOTable(SLO(0.1, 1)), clock)
    assert isinstance(core.route(facts(0)).outcome, Rejection)  # 0.2 s prefill > 0.1 s SLO
    assert len(core.pending) == 0


def test_every_policy_rejects_with_a_reason_and_a_retry_hint() -> None:
    cluster = StaticCluster((entry("p0", "prefill"), entry("d0", "decode", WorkerLoad(num_free_pages=1))))
    for name in policy_names():
        core = ConductorCore(cluster, make_policy(name, PolicyContext(costs=COSTS)), SLOTable(SLO(0.01, 0.001)),
                             ManualClock())
        out = core.route(facts(0)).outcome
        assert isinstance(out, Rejection), name
        assert out.reason and out.retry_after_s > 0, (name, out)


# --- the retry rule ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(FailureKind))
def test_only_failures_another_worker_may_not_have_are_retried(kind: FailureKind) -> None:
    retryable = kind in (FailureKind.UNAVAILABLE, FailureKind.BUSY, FailureKind.TRANSFER, FailureKind.STALLED)
    assert should_retry(kind, attempt=1, max_attempts=2, cancelled=False) is retryable
    assert should_retry(kind, attempt=2, max_attempts=2, cancelled=False) is False
    assert should_retry(kind, attempt=1, max_attempts=3, cancelled=True) is False


# --- config ------------------------------------------------------------------------------------


def test_config_comes_from_argv_over_environment_over_defaults() -> None:
    env = {"TIDEKV_MAX_RUNNING": "7", "TIDEKV_POLICY": "kv_cost", "TIDEKV_TENANT_SLOS": "a=1/0.1,b=2/0.2"}
    config = parse_config(ConductorConfig, ["--policy", "random"], env)
    assert (config.max_running, config.policy) == (7, "random")
    assert config.slos.resolve("a") == SLO(1.0, 0.1)
    assert config.slos.resolve("zzz") == SLO(config.ttft_slo_s, config.tbt_slo_s)
    assert config.slos.resolve("b", ttft_s=0.5) == SLO(0.5, 0.2)
    assert parse_config(ConductorConfig, [], {}) == ConductorConfig()


def test_bad_config_values_name_the_setting() -> None:
    with pytest.raises(ValueError, match="tenant_slos entry 'a=1'"):
        parse_tenant_slos(("a=1",))
    with pytest.raises(ValueError, match="admission_mode"):
        ConductorConfig(admission_mode="sometimes")
    with pytest.raises(SystemExit):
        parse_config(ConductorConfig, [], {"TIDEKV_MAX_RUNNING": "many"})
    with pytest.raises(SystemExit):
        parse_config(ConductorConfig, ["--policy", "nope"], {})
    with pytest.raises(SystemExit):
        parse_config(ConductorConfig, [], {"TIDEKV_POLICY": "mooncak"})


def test_a_worker_id_is_bound_to_its_instance() -> None:
    """The same instance registering again (a lost heartbeat) keeps its blocks; another
    instance is refused while the first is alive, and replaces it (dropping its blocks) once
    it has stopped heartbeating; a member may register only its own id."""
    from conductor.cluster import Cluster
    from kvstore.blocks import Tier
    from kvstore.index import BlockEvent
    from proto import internal_pb2 as ipb
    from runtime.auth import CONDUCTOR, Member, worker_principal

    now = [0.0]
    cluster = Cluster.in_memory(Member(b"s" * 64, CONDUCTOR), ttl_s=3.0, clock=lambda: now[0])
    index = cluster.state
    info = ipb.WorkerInfo(worker_id="p0", role=ipb.WORKER_ROLE_PREFILL, rpc_address="127.0.0.1:1",
                          transfer_address="tcp://127.0.0.1:2", model_fingerprint="fp", block_size=16,
                          instance_id="a" * 32)
    me = worker_principal("p0")
    assert cluster.register(info, me) is None
    key = bytes(16)
    index.apply([BlockEvent.stored("p0", key, Tier.DRAM, True)])
    assert cluster.register(info, me) is None  # the same process again: keeps its blocks
    assert index.match([key]).get("p0").num_blocks_present == 1
    other = ipb.WorkerInfo()
    other.CopyFrom(info)
    other.rpc_address, other.instance_id = "127.0.0.1:3", "b" * 32
    assert "alive at 127.0.0.1:1 as another instance" in cluster.register(other, me)
    assert cluster.session_key_for(me) is not None and cluster.endpoint("p0").info.rpc_address == "127.0.0.1:1"
    assert "may not register worker p0" in cluster.register(other, worker_principal("p1"))
    now[0] += 10  # the first instance stopped heartbeating
    index.reap_expired()
    assert cluster.register(other, me) is None
    assert cluster.endpoint("p0").info.rpc_address == "127.0.0.1:3"
    assert index.match([key]).get("p0").num_blocks_present == 0


def test_prefix_heat_stays_bounded_and_forgets_the_coldest_first() -> None:
    from conductor.heat import PrefixHeat

    heat = PrefixHeat(window_s=10.0, max_keys=100)
    for _ in range(5):
        heat.touch(b"hot", 0.0)
    for i in range(1000):
        heat.touch(i.to_bytes(4, "big"), 1.0 + i * 0.01)
        assert len(heat._counts) <= 100
    assert heat.rate(b"hot", 11.0) > 0.1  # 5 accesses 11 s ago outweigh 1 access a moment ago
    assert heat.rate((999).to_bytes(4, "big"), 11.0) > 0  # the newest stay
    assert heat.rate((0).to_bytes(4, "big"), 11.0) == 0  # the oldest single accesses went first


def test_the_first_of_its_own_jobs_runs_since_it_was_routed_or_the_last_prefill_there_ended() -> None:
    pending = PendingWork()

    def route(rid: str, now: float) -> None:
        pending.route(RouteRequest(rid, 0, 100, 6, 20, BS), RouteDecision("p", "d", ReusePlan(0, None)), now)

    def jobs(now: float, load: WorkerLoad | None = None) -> dict[str, float]:
        snap = build_snapshot((entry("p", "prefill", load or WorkerLoad()), entry("d", "decode")), None,
                              pending.view(), now)
        return {j.request_id: j.elapsed_s for j in snap.prefill[0].prefill_jobs}

    route("a", 0.0)
    route("b", 0.1)
    assert jobs(0.0) == {"a": 0.0, "b": 0.0}  # nothing has run yet
    assert jobs(0.3) == {"a": pytest.approx(0.3), "b": 0.0}  # a runs, b waits behind it
    pending.prefill_done("a", 0.4)
    assert jobs(0.5) == {"b": pytest.approx(0.1)}  # b started when a ended, not when it was routed
    route("c", 0.6)
    assert jobs(0.7) == {"b": pytest.approx(0.3), "c": 0.0}
    # A heartbeat that shows a job running is believed as it is.
    beat = WorkerLoad(prefill_jobs=(PrefillJobLoad("b", 100, 0, 0.05), PrefillJobLoad("c", 100)))
    assert jobs(0.7, beat) == {"b": pytest.approx(0.05), "c": 0.0}


def test_a_pending_view_is_the_same_viewed_often_or_once_and_never_changes_after() -> None:
    """Views reuse the last view's maps where no group changed: one viewed after every change
    equals one viewed only at the end, and an earlier view keeps what it held."""
    often, once = PendingWork(finished_ttl_s=0.5), PendingWork(finished_ttl_s=0.5)
    views: list[tuple[PendingView, dict]] = []
    maps = [f.name for f in dataclasses.fields(PendingView) if f.compare]  # what a view holds
    for i in range(6):
        req = RouteRequest(f"r{i}", i, 100, 6, 20, BS)
        steps = [("route", req, RouteDecision(f"p{i % 2}", f"d{i % 3}", ReusePlan(i % 3, None)), 0.1 * i)]
        if i >= 1:
            steps += [("prefill_done", f"r{i - 1}", 0.1 * i), ("decode_started", f"r{i - 1}", 0.1 * i),
                      ("generated", f"r{i - 1}", i)]
        if i >= 3:
            steps.append(("finish", f"r{i - 3}", 0.3 * i))
        for name, *args in steps:
            getattr(often, name)(*args)
            getattr(once, name)(*args)
            view = often.view()
            views.append((view, {name: dict(getattr(view, name)) for name in maps}))
    assert often.view() == once.view()
    for view, held in views:
        assert {name: dict(getattr(view, name)) for name in maps} == held
