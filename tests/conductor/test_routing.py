"""Routing policies: exact tests per policy and shared rule, then contract tests over every
registered policy (valid workers and roles, decode fits, rejections, purity, reuse cap)."""

from __future__ import annotations

import dataclasses

import pytest

from clusterstate.workers import PrefillJobLoad, WorkerRole
from conductor.policies import CacheAwareConfig, make_cache_aware
from conductor.routing import (
    ClusterSnapshot,
    Policy,
    PolicyContext,
    Rejection,
    ReusePlan,
    RouteBranch,
    RouteDecision,
    RouteRequest,
    WorkerView,
    decode_need_pages,
    make_policy,
    max_reuse_blocks,
    plan_reuse,
    policy_names,
    register_policy,
)
from costmodel import CostModels

BLOCK_SIZE = 4
# Every registered policy is built from this context; time-aware ones read these costs.
CONTEXT = PolicyContext(costs=CostModels.analytic(prefill_s_per_token=1e-3, decode_base_s=0.01,
                                                  decode_s_per_request=1e-3))


def get_policy(name: str) -> Policy:
    return make_policy(name, CONTEXT)


def prefill(worker_id: str, queue_len: int = 0, queued_tokens: int = 100, **fields) -> WorkerView:
    """A prefill worker holding ``queue_len`` prefills of ``queued_tokens`` new tokens each."""
    jobs = tuple(PrefillJobLoad(f"{worker_id}-q{i}", queued_tokens) for i in range(queue_len))
    return WorkerView(worker_id, "prefill", f"rpc-{worker_id}", f"tcp://xfer-{worker_id}", prefill_jobs=jobs, **fields)


def decode(worker_id: str, num_free_pages: int = 100, **fields: int) -> WorkerView:
    return WorkerView(
        worker_id, "decode", f"rpc-{worker_id}", f"tcp://xfer-{worker_id}", num_free_pages=num_free_pages, **fields
    )


def request(num_prompt_tokens: int = 17, max_tokens: int = 8, seq: int = 0) -> RouteRequest:
    return RouteRequest(
        request_id=f"r{seq}",
        seq=seq,
        num_prompt_tokens=num_prompt_tokens,
        num_blocks=num_prompt_tokens // BLOCK_SIZE,
        max_tokens=max_tokens,
        block_size=BLOCK_SIZE,
    )


def snapshot(prefills: list[WorkerView], decodes: list[WorkerView]) -> ClusterSnapshot:
    return ClusterSnapshot(prefill=tuple(prefills), decode=tuple(decodes), time_s=1.0)


def route(name: str, snap: ClusterSnapshot, req: RouteRequest) -> RouteDecision:
    decision = get_policy(name)(snap, req)
    assert isinstance(decision, RouteDecision), decision
    return decision


# --- shared rules ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_prompt_tokens", "expected"),
    [(1, 0), (3, 0), (4, 0), (5, 1), (8, 1), (9, 2), (16, 3), (17, 4)],
)
def test_reuse_cap_leaves_the_last_prompt_token_to_compute(num_prompt_tokens: int, expected: int) -> None:
    req = request(num_prompt_tokens)
    assert max_reuse_blocks(req) == expected
    assert max_reuse_blocks(req) * BLOCK_SIZE <= num_prompt_tokens - 1


def test_decode_need_covers_prompt_and_every_output_token() -> None:
    assert decode_need_pages(request(17, max_tokens=8)) == 7  # ceil(25 / 4)
    assert decode_need_pages(request(16, max_tokens=4)) == 5  # exactly 20 / 4


def test_reuse_is_local_when_own_prefix_is_as_deep_as_any_other() -> None:
    a, b = prefill("a", usable_blocks=3, usable_tier=1), prefill("b", usable_blocks=3, usable_tier=0)
    snap = snapshot([a, b], [decode("d")])
    assert plan_reuse(snap, request(17), a) == ReusePlan(num_blocks=3, holder=None)


def test_reuse_pulls_the_deeper_prefix_from_its_holder() -> None:
    a = prefill("a", usable_blocks=1, usable_tier=0)
    b = prefill("b", usable_blocks=2, usable_tier=2)
    c = prefill("c", usable_blocks=4, usable_tier=1)
    snap = snapshot([a, b, c], [decode("d")])
    assert plan_reuse(snap, request(17), a) == ReusePlan(num_blocks=4, holder="c")


def test_pull_ties_go_to_the_faster_tier_then_the_smaller_id() -> None:
    a = prefill("a")
    b = prefill("b", usable_blocks=2, usable_tier=2)
    c = prefill("c", usable_blocks=2, usable_tier=1)
    d = prefill("d", usable_blocks=2, usable_tier=1)
    snap = snapshot([a, d, b, c], [decode("x")])
    assert plan_reuse(snap, request(17), a) == ReusePlan(num_blocks=2, holder="c")


def test_reuse_is_capped_when_the_prompt_is_a_multiple_of_the_block_size() -> None:
    a = prefill("a", usable_blocks=4, usable_tier=0)
    snap = snapshot([a], [decode("d")])
    assert plan_reuse(snap, request(16), a) == ReusePlan(num_blocks=3, holder=None)


def test_cap_removes_a_pull_that_would_gain_only_the_last_block() -> None:
    # 16 tokens: cap 3. Own 3 vs other 4 -> both capped to 3, so no pull.
    a = prefill("a", usable_blocks=3, usable_tier=0)
    b = prefill("b", usable_blocks=4, usable_tier=0)
    snap = snapshot([a, b], [decode("d")])
    assert plan_reuse(snap, request(16), a) == ReusePlan(num_blocks=3, holder=None)


def test_min_pull_gain_keeps_a_small_gain_local() -> None:
    a = prefill("a", usable_blocks=2, usable_tier=0)
    b = prefill("b", usable_blocks=3, usable_tier=0)
    snap = snapshot([a, b], [decode("d")])
    assert plan_reuse(snap, request(17), a, min_pull_gain_blocks=2) == ReusePlan(2, None)
    assert plan_reuse(snap, request(17), a, min_pull_gain_blocks=1) == ReusePlan(3, "b")


def test_no_reuse_when_nobody_holds_a_block() -> None:
    a = prefill("a")
    snap = snapshot([a, prefill("b")], [decode("d")])
    assert plan_reuse(snap, request(17), a) == ReusePlan(num_blocks=0, holder=None)


# --- round robin ----------------------------------------------------------------------


def test_round_robin_cycles_in_worker_id_order() -> None:
    snap = snapshot([prefill("p2"), prefill("p0"), prefill("p1")], [decode("d1"), decode("d0")])
    picks = [route("round_robin", snap, request(seq=seq)) for seq in range(6)]
    assert [d.prefill_worker for d in picks] == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert [d.decode_worker for d in picks] == ["d0", "d1", "d0", "d1", "d0", "d1"]


def test_round_robin_skips_forward_past_a_full_decode_worker() -> None:
    need = decode_need_pages(request())
    snap = snapshot([prefill("p")], [decode("d0"), decode("d1", need - 1), decode("d2")])
    assert [route("round_robin", snap, request(seq=s)).decode_worker for s in range(3)] == ["d0", "d2", "d2"]


# --- least loaded ---------------------------------------------------------------------


def test_least_loaded_prefill_orders_by_queue_then_tokens() -> None:
    workers = [
        prefill("a", queue_len=2, queued_tokens=10),
        prefill("c", queue_len=1, queued_tokens=900),
        prefill("d", queue_len=1, queued_tokens=100, usable_blocks=0),
        prefill("e", queue_len=1, queued_tokens=100),
    ]
    assert route("least_loaded", snapshot(workers, [decode("x")]), request()).prefill_worker == "d"


def test_least_loaded_decode_prefers_fewest_running_then_most_free_among_fitting() -> None:
    need = decode_need_pages(request())
    decodes = [
        decode("idle-but-full", need - 1),
        decode("busy", 500, num_running=5),
        decode("small", need, num_running=1),
        decode("roomy", 50, num_running=1),
    ]
    assert route("least_loaded", snapshot([prefill("p")], decodes), request()).decode_worker == "roomy"


def test_least_loaded_still_pulls_a_prefix_it_does_not_hold() -> None:
    workers = [prefill("idle"), prefill("busy", queue_len=3, usable_blocks=4, usable_tier=1)]
    decision = route("least_loaded", snapshot(workers, [decode("d")]), request(17))
    assert decision == RouteDecision("idle", "d", ReusePlan(num_blocks=4, holder="busy"), RouteBranch.PULL)


# --- cache aware ----------------------------------------------------------------------


def test_cache_aware_picks_the_deepest_prefix_when_balanced() -> None:
    workers = [
        prefill("a", queue_len=0),
        prefill("b", queue_len=3, usable_blocks=3, usable_tier=1),
        prefill("c", queue_len=1, usable_blocks=1, usable_tier=0),
    ]
    decision = route("cache_aware", snapshot(workers, [decode("d")]), request(17))
    assert decision == RouteDecision("b", "d", ReusePlan(num_blocks=3, holder=None), RouteBranch.LOCAL)


def test_cache_aware_breaks_depth_ties_by_load() -> None:
    workers = [
        prefill("a", queue_len=2, usable_blocks=2, usable_tier=0),
        prefill("b", queue_len=1, usable_blocks=2, usable_tier=0),
        prefill("c", queue_len=0),
    ]
    assert route("cache_aware", snapshot(workers, [decode("d")]), request(17)).prefill_worker == "b"


def test_cache_aware_compares_depths_after_the_cap() -> None:
    # 16 tokens: cap 3, so 4 blocks on "deep" count as 3 and the less loaded "near" wins.
    workers = [
        prefill("deep", queue_len=2, usable_blocks=4, usable_tier=0),
        prefill("near", queue_len=1, usable_blocks=3, usable_tier=0),
    ]
    decision = route("cache_aware", snapshot(workers, [decode("d")]), request(16))
    assert decision == RouteDecision("near", "d", ReusePlan(num_blocks=3, holder=None), RouteBranch.LOCAL)


def test_cache_aware_switches_to_least_loaded_when_imbalanced() -> None:
    workers = [
        prefill("hot", queue_len=6, usable_blocks=4, usable_tier=0),
        prefill("cold", queue_len=1),
    ]
    decision = route("cache_aware", snapshot(workers, [decode("d")]), request(17))
    assert decision == RouteDecision("cold", "d", ReusePlan(num_blocks=4, holder="hot"), RouteBranch.PULL)


@pytest.mark.parametrize(
    ("queue_lens", "imbalanced"),
    [
        ((5, 1), False),  # gap 4 is not > 4
        ((6, 1), True),  # gap 5 > 4 and 6 > 1.5 * 1
        ((5, 0), True),
        ((20, 14), False),  # gap 6 > 4 but 20 <= 1.5 * 14
        ((22, 14), True),  # gap 8 > 4 and 22 > 21
    ],
)
def test_cache_aware_imbalance_needs_both_thresholds(queue_lens: tuple[int, int], imbalanced: bool) -> None:
    workers = [
        prefill("hot", queue_len=queue_lens[0], usable_blocks=4, usable_tier=0),
        prefill("cold", queue_len=queue_lens[1]),
    ]
    assert CacheAwareConfig().imbalanced(tuple(workers)) is imbalanced
    picked = route("cache_aware", snapshot(workers, [decode("d")]), request(17)).prefill_worker
    assert picked == ("cold" if imbalanced else "hot")


def test_cache_aware_config_is_injectable_and_validated() -> None:
    workers = [prefill("hot", queue_len=3, usable_blocks=4, usable_tier=0), prefill("cold", queue_len=1)]
    policy = make_cache_aware(CacheAwareConfig(balance_abs_threshold=1, balance_rel_threshold=1.5))
    decision = policy(snapshot(workers, [decode("d")]), request(17))
    assert isinstance(decision, RouteDecision) and decision.prefill_worker == "cold"
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        CacheAwareConfig(balance_rel_threshold=0.5)


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "cache_aware", "kv_cost", "random"])
def test_builtin_policies_reuse_the_deepest_capped_prefix_anywhere(name: str) -> None:
    # Whichever worker is chosen, it reuses (locally or by pulling) the deepest prefix: p0's
    # 10 blocks capped to 4 for a 17-token prompt.
    req = request(17)
    assert route(name, busy_cluster(), req).reuse.num_blocks == max_reuse_blocks(req) == 4


# --- registry and input validation ----------------------------------------------------


def test_registry_lists_the_builtin_policies() -> None:
    assert {"round_robin", "least_loaded", "cache_aware", "kv_cost", "random", "mooncake"} <= set(policy_names())
    assert policy_names() == sorted(policy_names())


def test_unknown_policy_names_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"'nope'.*cache_aware.*least_loaded.*round_robin"):
        get_policy("nope")


def test_a_name_cannot_be_registered_twice() -> None:
    from conductor import routing

    get_policy("round_robin")  # loads the built-in policies
    original = routing._FACTORIES["round_robin"]
    with pytest.raises(ValueError, match="already registered"):
        register_policy("round_robin")(lambda context: lambda snap, req: Rejection("x", 0.0))
    assert routing._FACTORIES["round_robin"] is original


def test_a_policy_that_needs_cost_models_says_so() -> None:
    with pytest.raises(ValueError, match="mooncake.*cost models"):
        make_policy("mooncake", PolicyContext())


def test_inputs_that_break_the_contract_raise_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"num_blocks 5 not in 0\.\.4"):
        RouteRequest("r", 0, num_prompt_tokens=17, num_blocks=5, max_tokens=1, block_size=4)
    with pytest.raises(ValueError, match="role"):
        snapshot([decode("d")], [decode("e")])
    with pytest.raises(ValueError, match="duplicate"):
        snapshot([prefill("w")], [decode("w")])
    with pytest.raises(ValueError, match="negative"):
        prefill("p", num_free_pages=-1)


# --- contract: every registered policy ------------------------------------------------

CONTRACT_REQUESTS = [
    request(17, 8, seq=3),
    request(16, 4, seq=4),
    request(3, 1, seq=5),
    request(40, 60, seq=6),
]


def busy_cluster() -> ClusterSnapshot:
    return snapshot(
        [
            prefill("p0", queue_len=1, usable_blocks=10, usable_tier=2),
            prefill("p1", queue_len=7, usable_blocks=4, usable_tier=0),
            prefill("p2", queue_len=1, queued_tokens=64, usable_blocks=2, usable_tier=1),
        ],
        [decode("d0", 30, num_running=3), decode("d1", 5), decode("d2", 12, num_running=1, num_queued=2)],
    )


@pytest.fixture(params=policy_names())
def policy_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("req", CONTRACT_REQUESTS, ids=lambda r: r.request_id)
def test_decision_obeys_the_shared_rules(policy_name: str, req: RouteRequest) -> None:
    snap = busy_cluster()
    decision = get_policy(policy_name)(snap, req)
    assert isinstance(decision, RouteDecision), decision
    check_decision(snap, req, decision)  # roles, decode fits, reuse within cap and held
    assert decision.reuse.num_blocks <= max_reuse_blocks(req)
    assert decision.reuse.num_blocks * req.block_size <= req.num_prompt_tokens - 1


@pytest.mark.parametrize("req", CONTRACT_REQUESTS, ids=lambda r: r.request_id)
def test_policy_is_pure(policy_name: str, req: RouteRequest) -> None:
    snap = busy_cluster()
    before = dataclasses.replace(snap), dataclasses.replace(req)
    policy = get_policy(policy_name)
    assert policy(snap, req) == policy(snap, req)
    assert (snap, req) == before


@pytest.mark.parametrize("req", CONTRACT_REQUESTS, ids=lambda r: r.request_id)
def test_reuse_never_wastes_the_chosen_workers_own_prefix(policy_name: str, req: RouteRequest) -> None:
    snap = busy_cluster()
    decision = get_policy(policy_name)(snap, req)
    assert isinstance(decision, RouteDecision)
    chosen = snap.find(decision.prefill_worker)
    assert chosen is not None
    assert decision.reuse.num_blocks >= min(chosen.usable_blocks, max_reuse_blocks(req))


@pytest.mark.parametrize(
    ("prefills", "decodes", "reason"),
    [
        ([], [decode("d")], "no prefill workers registered"),
        ([prefill("p")], [], "no decode workers registered"),
    ],
)
def test_rejects_without_workers(
    policy_name: str, prefills: list[WorkerView], decodes: list[WorkerView], reason: str
) -> None:
    rejection = get_policy(policy_name)(snapshot(prefills, decodes), request())
    assert isinstance(rejection, Rejection)
    assert rejection.reason == reason and rejection.retry_after_s > 0


def test_rejects_when_no_decode_worker_fits(policy_name: str) -> None:
    req = request(17, max_tokens=8)  # needs 7 pages
    snap = snapshot([prefill("p")], [decode("d0", 6), decode("d1", 3)])
    rejection = get_policy(policy_name)(snap, req)
    assert isinstance(rejection, Rejection)
    assert "need 7 free pages" in rejection.reason and "most free is 6 on d0" in rejection.reason
    assert rejection.retry_after_s == pytest.approx(1.0)


def test_exact_fit_is_accepted(policy_name: str) -> None:
    req = request(17, max_tokens=8)
    decision = get_policy(policy_name)(snapshot([prefill("p")], [decode("d0", 6), decode("d1", 7)]), req)
    assert isinstance(decision, RouteDecision) and decision.decode_worker == "d1"


def check_decision(snapshot: ClusterSnapshot, request: RouteRequest, decision: RouteDecision) -> None:
    """Assert that ``decision`` obeys the shared rules against ``snapshot``: workers exist in
    their roles, the decode worker fits, and the reuse plan is within the cap and held."""
    prefill = snapshot.find(decision.prefill_worker)
    decode = snapshot.find(decision.decode_worker)
    assert prefill is not None and prefill.role is WorkerRole.PREFILL, f"bad prefill worker {decision.prefill_worker}"
    assert decode is not None and decode.role is WorkerRole.DECODE, f"bad decode worker {decision.decode_worker}"
    need = decode_need_pages(request)
    assert decode.num_free_pages >= need, f"{decode.worker_id}: {decode.num_free_pages} free < {need}"
    reuse = decision.reuse
    assert 0 <= reuse.num_blocks <= max_reuse_blocks(request), f"reuse {reuse} over the cap"
    source = prefill if reuse.holder is None else snapshot.find(reuse.holder)
    assert source is not None and source.role is WorkerRole.PREFILL, f"bad holder {reuse.holder}"
    assert reuse.holder != prefill.worker_id, "holder must be another worker (None means own tiers)"
    assert source.usable_blocks >= reuse.num_blocks, f"{source.worker_id} holds fewer than {reuse}"
    assert (decision.branch is RouteBranch.COLD) == (reuse.num_blocks == 0), f"branch {decision.branch} for {reuse}"
    assert (decision.branch in (RouteBranch.PULL, RouteBranch.REPLICATE)) == (reuse.holder is not None), decision
