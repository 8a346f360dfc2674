"""Exact tests of the ``mooncake`` arithmetic on hand-built snapshots, with analytic cost
models whose every number can be computed by hand."""

from __future__ import annotations

import math
import random

import pytest

from clusterstate.workers import PrefillJobLoad
from conductor.decode_batch import DecodeJobs
from conductor.mooncake import queue_s, tbt_after_join
from conductor.routing import (
    ClusterSnapshot,
    DecodeJob,
    PolicyContext,
    Rejection,
    RejectKind,
    ReusePlan,
    RouteBranch,
    RouteDecision,
    RouteRequest,
    WorkerView,
    decode_need_pages,
    make_policy,
)
from conductor.routing_config import RoutingConfig
from costmodel import CostModels
from kvstore.blocks import Tier

BS = 10
# prefill: 1 ms per new token; decode step: 10 ms + 2 ms per request; transfer: 1 s per 1e6 bytes,
# 100 bytes per token of KV (so 1 ms per 10 tokens), no snapshot bytes.
COSTS = CostModels.analytic(prefill_s_per_token=1e-3, decode_base_s=0.010, decode_s_per_request=0.002,
                            transfer_bytes_per_s=1e6, kv_bytes_per_token=100)


def policy(**routing):
    return make_policy("mooncake", PolicyContext(RoutingConfig(**routing), COSTS))


def prefill(worker_id: str, usable_blocks: int = 0, jobs: tuple[PrefillJobLoad, ...] = ()) -> WorkerView:
    return WorkerView(worker_id, "prefill", f"rpc-{worker_id}", f"tcp://{worker_id}", prefill_jobs=jobs,
                      usable_blocks=usable_blocks, usable_tier=Tier.DRAM if usable_blocks else None)


def decode(worker_id: str, num_running: int = 0, jobs: tuple[DecodeJob, ...] = (), free: int = 1000) -> WorkerView:
    return WorkerView(worker_id, "decode", f"rpc-{worker_id}", f"tcp://{worker_id}", num_free_pages=free,
                      num_running=num_running, decode_jobs=jobs)


def request(n: int = 1001, ttft_slo_s: float = math.inf, tbt_slo_s: float = math.inf, max_tokens: int = 10):
    return RouteRequest("r", 0, n, n // BS, max_tokens, BS, ttft_slo_s, tbt_slo_s)


def snap(prefills, decodes=None, rate: float = 0.0) -> ClusterSnapshot:
    return ClusterSnapshot(tuple(prefills), tuple(decodes or [decode("d")]), 0.0, rate)


def queued(n: int, tokens: int) -> tuple[PrefillJobLoad, ...]:
    return tuple(PrefillJobLoad(f"q{i}", tokens) for i in range(n))


def test_queue_time_is_the_predicted_remaining_work() -> None:
    jobs = (PrefillJobLoad("run", 500, 0, elapsed_s=0.2), PrefillJobLoad("a", 100), PrefillJobLoad("b", 50, 40))
    # 0.5 - 0.2 still running + 0.1 + 0.05 (reused tokens cost nothing in these costs)
    assert queue_s(prefill("p", jobs=jobs), COSTS) == pytest.approx(0.45)
    overdue = (PrefillJobLoad("late", 100, 0, elapsed_s=5.0),)
    assert queue_s(prefill("p", jobs=overdue), COSTS) == 0.0


def test_the_cached_worker_with_a_long_queue_loses_to_an_idle_one() -> None:
    # 1001 tokens. holder: 80 cached blocks = 800 tokens, 2 s queued -> 2 + 0.201 = 2.201 s.
    # idle: best/local = inf > threshold, pull 800 tokens = 0.08 s + 0.201 s = 0.281 s.
    holder = prefill("holder", 80, queued(4, 500))
    decision = policy()(snap([holder, prefill("idle")]), request())
    assert decision == RouteDecision("idle", "d", ReusePlan(80, "holder"), RouteBranch.PULL, decision.predicted)
    assert decision.predicted.ttft_s == pytest.approx(0.08 + 0.201)
    assert decision.predicted.transfer_s == pytest.approx(0.08)


def test_the_cached_worker_wins_while_its_queue_is_short() -> None:
    # holder: 0.1 s queued + 0.201 = 0.301 s. With a 1e5 bytes/s link the 800-token pull to the
    # idle worker takes 0.8 s (1.001 s in all), so the holder wins.
    slow = CostModels.analytic(prefill_s_per_token=1e-3, decode_base_s=0.01, transfer_bytes_per_s=1e5,
                               kv_bytes_per_token=100)
    holder = prefill("holder", 80, queued(1, 100))
    decision = make_policy("mooncake", PolicyContext(costs=slow))(snap([holder, prefill("idle")]), request())
    assert isinstance(decision, RouteDecision)
    assert (decision.prefill_worker, decision.reuse, decision.branch) == ("holder", ReusePlan(80, None),
                                                                           RouteBranch.LOCAL)
    assert decision.predicted.ttft_s == pytest.approx(0.1 + 0.201)


def test_an_idle_cold_worker_wins_over_a_busy_holder_when_the_prefix_is_short() -> None:
    # holder: 1 block cached, 1 s queued -> 1 + 0.991 s. The idle worker holds nothing, so any
    # prefix is beyond the threshold: it pulls the block (10 tokens, 1 ms) and wins.
    holder = prefill("holder", 1, queued(2, 500))
    decision = policy()(snap([holder, prefill("cold")]), request())
    assert isinstance(decision, RouteDecision) and decision.prefill_worker == "cold"
    assert decision.predicted.ttft_s == pytest.approx(0.001 + 0.991)


@pytest.mark.parametrize(("local_blocks", "pull"), [(40, True), (50, False), (60, False)])
def test_the_pull_branch_is_taken_exactly_beyond_the_threshold(local_blocks: int, pull: bool) -> None:
    # best = 75 blocks on "holder" (kept busy so it is not chosen); "w" holds local_blocks.
    # threshold 1.5: pull considered iff 75 > 1.5 * local, i.e. local < 50.
    holder = prefill("holder", 75, queued(10, 1000))
    w = prefill("w", local_blocks)
    decision = policy(balancing_threshold=1.5)(snap([holder, w]), request())
    assert isinstance(decision, RouteDecision) and decision.prefill_worker == "w"
    assert decision.reuse == (ReusePlan(75, "holder") if pull else ReusePlan(local_blocks, None))
    # pull: 750 tokens in 0.075 s then 251 new tokens; local: (1001 - 10 * local) new tokens
    expected = 0.075 + 0.251 if pull else (1001 - 10 * local_blocks) * 1e-3
    assert decision.predicted.ttft_s == pytest.approx(expected)


def test_no_pull_when_the_prefix_already_has_max_replicas() -> None:
    a, b = prefill("a", 75, queued(10, 1000)), prefill("b", 75, queued(10, 1000))
    decision = policy(max_replicas=2)(snap([a, b, prefill("c")]), request())
    assert isinstance(decision, RouteDecision)
    assert decision.prefill_worker == "c" and decision.reuse == ReusePlan(0, None)
    assert decision.branch is RouteBranch.COLD


def test_the_decode_choice_follows_predicted_tbt() -> None:
    # batch after joining: busy 3 + 1 -> 10 + 8 = 18 ms; idle 0 + 1 -> 12 ms
    decision = policy()(snap([prefill("p")], [decode("busy", 3), decode("idle", 0)]), request())
    assert isinstance(decision, RouteDecision) and decision.decode_worker == "idle"
    assert decision.predicted.tbt_s == pytest.approx(0.012)


def test_predictive_admission_counts_what_will_have_left_and_joined() -> None:
    # d1 runs 2 requests at 14 ms a step: "short" ends after 5 tokens (0.07 s), "long" after 500
    # (7 s); "soon" joins in 0.5 s, "late" in 5 s. Batch with this request at t = 1.001 s: long +
    # soon + this = 3 -> 16 ms; now: 2 running + this = 3 -> 16 ms; at 6 s late has joined too.
    jobs = (DecodeJob("short", 100, 5), DecodeJob("long", 100, 500), DecodeJob("soon", 100, 10, False, 0.5),
            DecodeJob("late", 100, 10, False, 5.0))
    d = decode("d1", num_running=2, jobs=jobs)
    req = request()
    assert tbt_after_join(d, req, COSTS, at_s=1.001) == pytest.approx(0.010 + 3 * 0.002)
    assert tbt_after_join(d, req, COSTS, at_s=None) == pytest.approx(0.010 + 3 * 0.002)
    assert tbt_after_join(d, req, COSTS, at_s=6.0) == pytest.approx(0.010 + 4 * 0.002)  # late joined
    assert tbt_after_join(d, req, COSTS, at_s=0.01) == pytest.approx(0.010 + 3 * 0.002)  # nobody left yet


def test_early_and_predictive_admission_differ_on_the_same_snapshot() -> None:
    # 4 running that all finish within 0.1 s; this request reaches decode after 1.001 s.
    # early: 5 in the batch -> 20 ms > 15 ms SLO: rejected. predictive: alone -> 12 ms: admitted.
    jobs = tuple(DecodeJob(f"r{i}", 100, 2) for i in range(4))
    s = snap([prefill("p")], [decode("d", 4, jobs)])
    req = request(tbt_slo_s=0.015)
    early = policy(admission_mode="early")(s, req)
    assert isinstance(early, Rejection) and early.kind is RejectKind.TBT_SLO
    assert "20.0ms" in early.reason and early.retry_after_s > 0
    admitted = policy(admission_mode="predictive")(s, req)
    assert isinstance(admitted, RouteDecision) and admitted.predicted.tbt_s == pytest.approx(0.012)
    assert isinstance(policy(admission_mode="none")(s, req), RouteDecision)


def test_predictive_tbt_covers_requests_joining_while_this_one_decodes() -> None:
    # This request reaches decode at ttft = 1.001 s. "soon" (ready at 0.5 s) has joined by then:
    # 2 in the batch, 14 ms a step, so its 10 tokens take until 1.141 s; "late" (1.05 s) joins
    # within that, "later" (2.0 s) does not: the prediction is the 3-request batch, 16 ms.
    jobs = (DecodeJob("soon", 100, 10, False, 0.5), DecodeJob("late", 100, 10, False, 1.05),
            DecodeJob("later", 100, 10, False, 2.0))
    d, req = decode("d", jobs=jobs), request()
    decision = policy()(snap([prefill("p")], [d]), req)
    assert isinstance(decision, RouteDecision) and decision.predicted.ttft_s == pytest.approx(1.001)
    ttft = decision.predicted.ttft_s
    first = tbt_after_join(d, req, COSTS, ttft)
    assert first == pytest.approx(0.014)
    assert decision.predicted.tbt_s == tbt_after_join(d, req, COSTS, ttft, 0.0, ttft + req.max_tokens * first)
    assert decision.predicted.tbt_s == pytest.approx(0.016)


@pytest.mark.parametrize(("slo_s", "rejected"), [(1.0, True), (1.0011, False), (2.0, False)])
def test_a_request_that_cannot_meet_its_ttft_slo_is_rejected(slo_s: float, rejected: bool) -> None:
    # cold prefill of 1001 tokens on an idle worker: 1.001 s
    outcome = policy()(snap([prefill("p")]), request(ttft_slo_s=slo_s))
    if rejected:
        assert isinstance(outcome, Rejection) and outcome.kind is RejectKind.TTFT_SLO
        assert "1.001s misses the 1s SLO" in outcome.reason
        assert outcome.retry_after_s >= 0.5
    else:
        assert isinstance(outcome, RouteDecision)


def test_a_hot_prefix_on_a_busy_holder_is_replicated() -> None:
    # holder: 80 blocks, 0.05 s queued -> 0.05 + 0.201 = 0.251 s beats the pull to "idle"
    # (0.08 + 0.201 = 0.281 s). When the prefix is hot, the decision replicates it instead.
    holder = prefill("holder", 80, queued(1, 50))
    s_cold, s_hot = snap([holder, prefill("idle")], rate=0.1), snap([holder, prefill("idle")], rate=5.0)
    local = policy(hot_prefix_rate_per_s=1.0)(s_cold, request())
    assert isinstance(local, RouteDecision) and (local.prefill_worker, local.branch) == ("holder", RouteBranch.LOCAL)
    hot = policy(hot_prefix_rate_per_s=1.0)(s_hot, request())
    assert isinstance(hot, RouteDecision)
    assert (hot.prefill_worker, hot.reuse, hot.branch) == ("idle", ReusePlan(80, "holder"), RouteBranch.REPLICATE)
    # not when the replica would miss the TTFT SLO, nor when the holder is idle
    assert policy()(snap([holder, prefill("idle")], rate=5.0), request(ttft_slo_s=0.27)).branch is RouteBranch.LOCAL
    idle_holder = prefill("holder", 80)
    assert policy()(snap([idle_holder, prefill("idle")], rate=5.0), request()).branch is RouteBranch.LOCAL


def test_a_worker_that_runs_slower_than_calibrated_predicts_longer() -> None:
    from conductor.speed import WorkerSpeed

    jobs = queued(1, 500)
    slow = WorkerView("slow", "prefill", "rpc", "tcp://slow", prefill_jobs=jobs, slowdown=2.0)
    fast = WorkerView("fast", "prefill", "rpc", "tcp://fast", prefill_jobs=jobs)
    assert queue_s(slow, COSTS) == pytest.approx(2 * queue_s(fast, COSTS)) == pytest.approx(1.0)
    decision = policy()(snap([slow, fast]), request())
    assert decision.prefill_worker == "fast" and decision.predicted.ttft_s == pytest.approx(0.5 + 1.001)

    assert decision.predicted.slowdown == 1.0 and decision.predicted.model_prefill_s == decision.predicted.prefill_s

    speed = WorkerSpeed(weight=0.5)
    speed.observe("w", calibrated_s=1.0, observed_s=3.0)  # (0.25 + 3) / (0.25 + 1)
    assert speed.factors() == {"w": pytest.approx(3.25 / 1.25)}
    for _ in range(3):  # three prefills decided under the same factor: averaged, never compounded
        speed.observe("w", calibrated_s=1.0, observed_s=3.0)
    assert 2.6 < speed.factors()["w"] < 3.0
    speed.observe("w", calibrated_s=0.001, observed_s=0.05)  # a tiny prefill 50x its prediction
    assert speed.factors()["w"] < 3.05  # moves it by its milliseconds, not by 50x
    speed.observe("w", calibrated_s=1.0, observed_s=1000.0)
    assert speed.factors()["w"] == 8.0  # clamped


def test_a_workers_hand_off_and_dispatch_add_to_its_predictions_and_not_to_its_factor() -> None:
    from conductor.speed import WorkerSpeed, dispatch_of

    speed = WorkerSpeed(weight=0.5)
    # 1.5 s of prefill of which 0.5 s handing off the KV: the engine ran at the calibrated speed
    speed.observe("w", calibrated_s=1.0, observed_s=1.5, handoff_s=0.5, dispatch_s=0.02)
    pace = speed.paces()["w"]
    assert (pace.slowdown, pace.handoff_s, pace.dispatch_s) == (pytest.approx(1.0), 0.5, 0.02)  # first samples set
    speed.observe("w", calibrated_s=1.0, observed_s=1.1, handoff_s=0.1)  # no dispatch measured: its mean stays
    pace = speed.paces()["w"]
    assert (pace.handoff_s, pace.dispatch_s) == (pytest.approx(0.3), 0.02)
    speed.observe("w", calibrated_s=0.01, observed_s=0.5, handoff_s=0.49)  # a tiny prefill: slow only by its hand-off
    assert speed.factors()["w"] == pytest.approx(1.0)
    assert dispatch_of(0.3, 0.1, 0.2) == 0.0 and dispatch_of(0.3, 0.1, 0.15) == pytest.approx(0.05)
    assert dispatch_of(0.1, 0.2, 0.0) == 0.0  # never negative

    jobs = queued(1, 500)  # 0.5 s calibrated
    w = WorkerView("w", "prefill", "rpc", "tcp://w", prefill_jobs=jobs, slowdown=2.0, handoff_s=0.1, dispatch_s=0.01)
    assert queue_s(w, COSTS) == pytest.approx(2 * 0.5 + 0.1)  # a queued job holds the engine through its hand-off
    decision = policy()(snap([w]), request())
    p = decision.predicted
    assert (p.queue_s, p.prefill_s, p.dispatch_s, p.handoff_s) == pytest.approx((1.1, 2 * 1.001 + 0.1, 0.01, 0.1))
    assert p.ttft_s == pytest.approx(0.01 + 1.1 + 2.102)
    assert p.model_prefill_s == pytest.approx(1.001)  # what the speed tracker compares with the engine's time


def _random_decode(rng: random.Random, worker_id: str, now_s: float) -> WorkerView:
    jobs = DecodeJobs(DecodeJob(f"{worker_id}-{i}", rng.randint(10, 3000), rng.randint(0, 400), rng.random() < 0.7,
                                now_s + rng.uniform(-0.5, 3.0)) for i in range(rng.randint(0, 10)))
    running = sum(j.decoding for j in jobs) + rng.choice([0, 0, 2])  # some another Conductor's
    context = sum(j.num_tokens for j in jobs if j.decoding) + rng.choice([0, 500])
    return WorkerView(worker_id, "decode", f"rpc-{worker_id}", f"tcp://{worker_id}",
                      num_free_pages=rng.choice([5, 400, 1000, 1000]), num_running=running,
                      num_context_tokens=context, decode_jobs=jobs)


def test_the_predictive_decode_choice_is_a_full_pass_over_tbt_after_join() -> None:
    """The policy's decode choice (one pass with each view's basis kept between decisions)
    equals the minimum of (TBT, fewer free pages, id) over every fitting worker, each TBT the
    second ``tbt_after_join`` prediction, through histories where some views change and
    workers join and leave."""
    costs = CostModels.analytic(prefill_s_per_token=1e-4, decode_base_s=0.010, decode_s_per_request=0.002,
                                decode_s_per_context_token=1e-6)
    rng, decide = random.Random(5), make_policy("mooncake", PolicyContext(RoutingConfig(), costs))
    views = [_random_decode(rng, f"d{i:02d}", 0.0) for i in range(12)]
    for step in range(400):
        now_s = step * 0.05
        for _ in range(rng.choice([0, 1, 3])):
            i = rng.randrange(len(views))
            views[i] = _random_decode(rng, views[i].worker_id, now_s)
        if rng.random() < 0.1:
            if len(views) > 12:
                views.pop(rng.randrange(len(views)))
            else:
                views.insert(rng.randrange(len(views)), _random_decode(rng, f"new{step}", now_s))
        n = rng.randint(1, 4000)
        req = RouteRequest(f"r{step}", step, n, n // BS, rng.randint(1, 500), BS, math.inf, math.inf)
        jobs = queued(rng.randint(0, 3), rng.randint(10, 2000))
        s = ClusterSnapshot((prefill("p", jobs=jobs),), tuple(views), now_s, 0.0)
        decision = decide(s, req)
        if isinstance(decision, Rejection):
            assert not any(v.num_free_pages >= decode_need_pages(req) for v in views), decision
            continue
        ttft_s, scored = decision.predicted.ttft_s, []
        for w in views:
            if w.num_free_pages >= decode_need_pages(req):
                first = tbt_after_join(w, req, costs, ttft_s, now_s)
                tbt = tbt_after_join(w, req, costs, ttft_s, now_s, ttft_s + req.max_tokens * first)
                scored.append((tbt, -w.num_free_pages, w.worker_id))
        tbt, _, worker_id = min(scored)
        assert (decision.decode_worker, decision.predicted.tbt_s) == (worker_id, tbt), step
