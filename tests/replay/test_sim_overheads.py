"""The live cluster's overheads in the simulator (``costmodel.overheads``, ``replay.sim``) and
their fit from per-request records (``replay.sim.fit``): exact effects on tiny runs with
analytic cost models, the Conductor's speed feedback, and the fit recovering the overheads a
simulated run was made with. No timing: every figure is the simulator's own arithmetic."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conductor.config import ConductorConfig
from conductor.speed import PRIOR_S
from costmodel import CostModels
from costmodel.overheads import NO_OVERHEADS, ClusterOverheads
from decode_worker.config import DecodeConfig
from prefill_worker.config import PrefillConfig
from replay.records import RequestRecord
from replay.sim.fit import _plain_nnls, _robust_nnls, fit_overheads, prefill_observations
from replay.sim.run import SimConfig, Simulation, simulate
from replay.transform import ReplayRequest, ScaledTrace, TraceTransform

BLOCK = 16
COSTS = CostModels.analytic(prefill_s_per_token=1e-3, decode_base_s=0.01, decode_s_per_request=1e-3,
                            kv_bytes_per_token=1280, snapshot_bytes=300_000)
OPEN = ConductorConfig(max_running=10**6, max_queued=10**6, ttft_slo_s=1e9, tbt_slo_s=1e9)
ONE_BY_ONE = SimConfig(1, 1, OPEN, PrefillConfig(snapshot_interval_blocks=1), DecodeConfig())


def trace(*requests: tuple[float, int, int, tuple[int, ...]]) -> ScaledTrace:
    """(arrival s, prompt tokens, max tokens, hash ids) -> a scaled trace of 16-token blocks."""
    reqs = tuple(ReplayRequest(f"t{i}", i, arrival, prompt, max_tokens, hash_ids=ids, tokens_per_block=BLOCK)
                 for i, (arrival, prompt, max_tokens, ids) in enumerate(requests))
    return ScaledTrace(TraceTransform(trace_block_tokens=BLOCK, block_size=BLOCK), reqs, "test", "mooncake",
                       len(reqs), 0.0, 0, 0)


def ids(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def run(scaled: ScaledTrace, overheads: ClusterOverheads = NO_OVERHEADS, **kw) -> tuple[RequestRecord, ...]:
    return simulate(scaled, dataclasses.replace(ONE_BY_ONE, overheads=overheads, **kw), COSTS).records


def test_overheads_validate_interpolate_and_round_trip(tmp_path) -> None:
    o = ClusterOverheads(dispatch_s=0.002, prefill_coefficients=(0.01, 2e-3, 0.0, 0.0, 1e-5),
                         delivery_delay_quantiles_s=(0.0, 0.002, 0.004, 0.010), prefill_ratio_quantiles=(0.8, 1.2),
                         source="hand-set")
    assert o.prefill_ratio(0.5) == pytest.approx(1.0) and ClusterOverheads().prefill_ratio(0.9) == 1.0
    # quantile i sits at probability (i + 0.5) / 4: 0.125, 0.375, 0.625, 0.875
    assert o.delivery_delay_s(0.0) == 0.0 and o.delivery_delay_s(0.99) == 0.010
    assert o.delivery_delay_s(0.375) == pytest.approx(0.002)
    assert o.delivery_delay_s(0.5) == pytest.approx(0.003)
    assert o.live_prefill(COSTS).prefill_s(100, 1000) == pytest.approx(0.01 + 0.2 + 0.01)
    assert ClusterOverheads().live_prefill(COSTS) is COSTS
    o.save(tmp_path / "o.json")
    assert ClusterOverheads.load(tmp_path / "o.json") == o
    with pytest.raises(ValueError, match="non-decreasing"):
        ClusterOverheads(delivery_delay_quantiles_s=(0.002, 0.001))
    with pytest.raises(ValueError, match="prefill_coefficients"):
        ClusterOverheads(prefill_coefficients=(1.0, 2.0))
    with pytest.raises(ValueError, match="decode_step_scale"):
        ClusterOverheads(decode_step_scale=0.0)
    (tmp_path / "bad.json").write_text('{"format": "tidekv-overheads", "version": 1, "dispatch_s": -1}')
    with pytest.raises(ValueError, match="bad.json"):
        ClusterOverheads.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="decode_stall_s_per_arrival"):
        ClusterOverheads(decode_stall_s_per_arrival=-1e-3)
    # A file written before the event stalls existed: they default to none.
    (tmp_path / "old.json").write_text('{"format": "tidekv-overheads", "version": 1, "dispatch_s": 0.002}')
    old = ClusterOverheads.load(tmp_path / "old.json")
    assert old.decode_stall_s_per_prefill == old.decode_stall_s_per_arrival == 0.0 and old.dispatch_s == 0.002


def test_each_overhead_lands_where_the_live_cluster_pays_it() -> None:
    # One request alone: 160 prompt tokens (10 blocks), 4 tokens out; a 1-request decode step
    # is 0.011 s.
    lone = trace((0.0, 160, 4, ids(10)))
    (base,) = run(lone)
    assert base.ttft_s == pytest.approx(0.160)
    assert base.token_times_s == pytest.approx((0.160, 0.171, 0.182, 0.193))
    o = ClusterOverheads(dispatch_s=0.003, prefill_coefficients=(0.02, 1.5e-3, 0.0, 0.0, 0.0),
                         decode_join_quantiles_s=(0.004,), decode_step_scale=2.0)
    (r,) = run(lone, o)
    ttft = 0.003 + 0.02 + 1.5e-3 * 160
    assert r.ttft_s == pytest.approx(ttft) and r.queue_s == pytest.approx(0.003)
    assert r.token_times_s == pytest.approx((ttft, ttft + 0.004 + 0.022, ttft + 0.004 + 0.044, ttft + 0.004 + 0.066))


def test_delivery_delays_keep_the_stream_in_order() -> None:
    lone = trace((0.0, 160, 12, ids(10)))
    (base,) = run(lone)
    (flat,) = run(lone, ClusterOverheads(delivery_delay_quantiles_s=(0.005,) * 4))
    assert flat.token_times_s[0] == base.token_times_s[0]  # the first token comes from the prefill
    assert flat.token_times_s[1:] == pytest.approx(tuple(t + 0.005 for t in base.token_times_s[1:]))
    spread = ClusterOverheads(delivery_delay_quantiles_s=(0.0, 0.0, 0.0, 0.050))
    (a,) = run(lone, spread, seed=1)
    (b,) = run(lone, spread, seed=1)
    assert a.token_times_s == b.token_times_s  # seeded
    gaps = [y - x for x, y in zip(a.token_times_s, a.token_times_s[1:], strict=False)]
    assert min(gaps) >= 0 and max(gaps) > 0.02  # some token was held back, none overtook another
    assert all(t >= m for t, m in zip(a.token_times_s, base.token_times_s, strict=True))


def test_pushing_reused_rows_stalls_the_decode_loop_once() -> None:
    # t0 decodes 30 tokens from 0.160 s in 11 ms steps; t1 arrives at 0.2 s, reuses t0's ten
    # blocks (160 tokens) and prefills alone: its push stretches the step t0 is in by 16 ms.
    scaled = trace((0.0, 160, 30, ids(10)), (0.2, 165, 1, (*ids(10), 500)))
    base, _ = run(scaled)
    stalled, reusing = run(scaled, ClusterOverheads(decode_stall_s_per_reused_token=1e-4))
    assert reusing.cached_tokens == 160
    gaps = [b - a for a, b in zip(stalled.token_times_s, stalled.token_times_s[1:], strict=False)]
    assert sorted(gaps)[-1] == pytest.approx(0.011 + 0.016)
    assert sorted(gaps)[-2] == pytest.approx(0.011)
    assert stalled.token_times_s[-1] - base.token_times_s[-1] == pytest.approx(0.016)


def test_arrivals_and_prefill_ends_stretch_the_step_in_progress() -> None:
    # t0 decodes 30 tokens from 0.160 s in 11 ms steps. t1 arrives at 0.2 s (in t0's step
    # 0.193..0.204: +2 ms from then on) and prefills 165 tokens alone; its prefill ends at
    # 0.365 s (in t0's step 0.360..0.371, already 2 ms late: +4 ms more). t1 makes one token,
    # so it never joins. t0's own arrival (at 0) and prefill end (at 0.160) find the loop idle:
    # an arrival pauses an idle loop (long over by 0.160), a prefill end does not.
    scaled = trace((0.0, 160, 30, ids(10)), (0.2, 165, 1, ids(10, start=500)))
    o = ClusterOverheads(decode_stall_s_per_prefill=0.004, decode_stall_s_per_arrival=0.002)
    t0, t1 = run(scaled, o)
    assert t1.ttft_s == pytest.approx(0.165)
    expected = [0.160 + 0.011 * k + 0.002 * (k >= 4) + 0.004 * (k >= 19) for k in range(30)]
    assert t0.token_times_s == pytest.approx(tuple(expected))


def test_a_prefill_end_does_not_delay_its_own_join_into_an_idle_loop() -> None:
    lone = trace((0.0, 160, 3, ids(10)))
    (r,) = run(lone, ClusterOverheads(decode_stall_s_per_prefill=0.004, decode_join_quantiles_s=(0.003,)))
    assert r.token_times_s == pytest.approx((0.160, 0.160 + 0.003 + 0.011, 0.160 + 0.003 + 0.022))


def test_a_stall_keeps_a_joining_request_waiting_for_the_step_in_progress() -> None:
    # t0 decodes 30 tokens from 0.160 s in 11 ms steps. t1 (160 tokens, 3 out) prefills alone
    # from 0.2 s; its prefill ends at 0.360 s, in t0's step 0.358..0.369, which its 4 ms stall
    # stretches to 0.373. t1 joins there, not in that step: two steps of a batch of 2 (12 ms),
    # then t0 goes on alone.
    scaled = trace((0.0, 160, 30, ids(10)), (0.2, 160, 3, ids(10, start=500)))
    t0, t1 = run(scaled, ClusterOverheads(decode_stall_s_per_prefill=0.004))
    assert t1.token_times_s == pytest.approx((0.160, 0.173 + 0.012, 0.173 + 0.024))  # relative to 0.2 s
    alone = [0.160 + 0.011 * k for k in range(19)]
    together = [0.373, 0.385, 0.397]
    after = [0.397 + 0.011 * k for k in range(1, 9)]
    assert t0.token_times_s == pytest.approx(tuple(alone + together + after))


def test_a_stall_rests_on_enough_gaps_or_stays_zero() -> None:
    # t0 decodes 30 tokens from 0.160 s; t1..t3 (one token each) queue behind it and their
    # prefills end at 0.256, 0.352 and 0.448 s, in three of t0's gaps, each 4 ms longer. Three
    # gaps are too few to tell a stall per prefill from late tokens: it stays 0 and the three
    # 4 ms become delivery delays.
    scaled = trace((0.0, 160, 30, ids(10)), *[(0.001 * i, 96, 1, ids(6, start=100 * i)) for i in (1, 2, 3)])
    records = run(scaled, ClusterOverheads(decode_stall_s_per_prefill=0.004))
    gaps = sorted(b - a for a, b in zip(records[0].token_times_s, records[0].token_times_s[1:], strict=False))
    assert gaps[-4:] == pytest.approx([0.011, 0.015, 0.015, 0.015])
    got = fit_overheads(records, COSTS).overheads
    assert got.decode_stall_s_per_prefill == 0.0 and got.decode_step_scale == pytest.approx(1.0)
    assert max(got.delivery_delay_quantiles_s) == pytest.approx(0.004)


def test_the_decode_fit_weighs_an_outlying_gap_as_one_gap() -> None:
    # Ten gaps of exactly 2 calibrated steps and one 0.5 s late: plain least squares moves the
    # scale by the late gap's share, the Huber weights all but ignore it.
    steps = np.array([[0.01 * (1 + i % 3)] for i in range(11)])
    gaps = 2.0 * steps[:, 0]
    gaps[5] += 0.5
    assert _plain_nnls(steps, gaps)[0] > 2.5
    assert _robust_nnls(steps, gaps)[0] == pytest.approx(2.0, rel=1e-3)


def test_the_simulated_conductor_learns_the_worker_speed_as_the_live_one_does() -> None:
    # Two requests at once: the second is decided while the first runs, with the factor at 1.
    scaled = trace((0.0, 160, 1, ids(10)), (0.0, 320, 1, ids(20, 100)))
    o = ClusterOverheads(prefill_coefficients=(0.04, 1e-3, 0.0, 0.0, 0.0))  # 40 ms more than predicted
    sim = Simulation(scaled, dataclasses.replace(ONE_BY_ONE, overheads=o), COSTS)
    sim.run()
    keep = 1 - sim.core.speed.weight
    obs = cal = PRIOR_S
    for calibrated, observed in ((0.160, 0.200), (0.320, 0.360)):  # conductor.speed's decayed sums
        obs, cal = keep * obs + observed, keep * cal + calibrated
    assert sim.core.speed.factors()["prefill-0"] == pytest.approx(obs / cal)
    untouched = Simulation(scaled, ONE_BY_ONE, COSTS)
    untouched.run()
    assert untouched.core.speed.factors()["prefill-0"] == pytest.approx(1.0)


def test_the_fit_recovers_the_overheads_a_simulated_run_was_made_with() -> None:
    # A queue of prefills (half reusing an earlier prefix) and overlapping decodes, long enough
    # that every stall's event falls in more than MIN_EVENT_GAPS gaps.
    requests = []
    for i in range(40):
        shared = ids(6) if i % 2 == 0 else ()
        own = ids(4 + (i * 7) % 15, start=1000 + 100 * i)
        requests.append((0.05 * i, 16 * len(shared + own) + 5, 12 + i % 9, shared + own))
    scaled = trace(*requests)
    truth = ClusterOverheads(dispatch_s=0.002, prefill_coefficients=(0.015, 1.2e-3, 0.0, 0.0, 5e-5),
                             decode_join_quantiles_s=(0.003,), decode_step_scale=1.3,
                             decode_stall_s_per_reused_token=2e-4, decode_stall_s_per_prefill=0.004,
                             decode_stall_s_per_arrival=0.002)
    records = run(scaled, truth)
    observations = prefill_observations(records)
    assert len(observations) == 40 and any(reused for _, reused, _, _ in observations)
    got = fit_overheads(records, COSTS).overheads
    assert got.dispatch_s == pytest.approx(truth.dispatch_s)
    assert got.prefill_coefficients == pytest.approx(truth.prefill_coefficients, rel=1e-6, abs=1e-12)
    assert got.decode_step_scale == pytest.approx(truth.decode_step_scale, rel=0.02)
    assert got.decode_stall_s_per_reused_token == pytest.approx(truth.decode_stall_s_per_reused_token, rel=0.1)
    assert got.decode_stall_s_per_prefill == pytest.approx(truth.decode_stall_s_per_prefill, rel=0.02)
    assert got.decode_stall_s_per_arrival == pytest.approx(truth.decode_stall_s_per_arrival, rel=0.02)
    # Read off the joins into an idle loop, as the simulator made them: a push that paused the
    # loop meanwhile (the next prefill's, as this one ends) is neither added nor subtracted.
    assert got.decode_join_quantiles_s == pytest.approx((0.003,) * len(got.decode_join_quantiles_s), abs=1e-9)
    assert max(got.delivery_delay_quantiles_s) < 5e-4  # none were simulated (what is left: the fit's error)
    with pytest.raises(ValueError, match="2 timed prefills"):
        fit_overheads(records[:2], COSTS)


def test_the_prefill_fit_survives_responses_that_come_back_out_of_order() -> None:
    # Back-to-back prefills of 96..400 tokens, t11 of one block; the first token of t10 (400
    # tokens) comes back just after t11's, as two live responses can: t10's gap then reads 1 ms
    # and t11's holds both prefills.
    # An older report, without the workers' own times: the fit reads the gaps.
    sizes = [1 if i == 11 else 25 if i == 10 else 6 + (i * 5) % 20 for i in range(30)]
    scaled = trace(*[(0.001 * i, 16 * n, 1, ids(n, start=100 * i)) for i, n in enumerate(sizes)])
    truth = ClusterOverheads(prefill_coefficients=(0.03, 1.1e-3, 0.0, 0.0, 0.0))
    records = [dataclasses.replace(r, prefill_worker_s=None) for r in run(scaled, truth)]
    first = {r.index: r.arrival_s + r.ttft_s for r in records}
    records[10] = dataclasses.replace(records[10], ttft_s=first[11] + 1e-3 - records[10].arrival_s)
    got = fit_overheads(records, COSTS).overheads.prefill_coefficients
    assert got == pytest.approx(truth.prefill_coefficients, rel=0.05, abs=1e-6)


def test_reuse_copied_into_pages_costs_its_own_term_and_the_fit_recovers_it() -> None:
    # A device tier of 20 blocks: a 6-block prefix shared by every third request is reused in
    # place while it is still there and copied in from DRAM once newer blocks have pushed it
    # down. Arrivals 0.4 s apart leave the worker idle before each prefill.
    blob = BLOCK * COSTS.kv_bytes_per_token + COSTS.snapshot_bytes
    small_device = dataclasses.replace(ONE_BY_ONE.prefill, device_bytes=20 * blob)
    chains = [(ids(6) if i % 3 == 0 else ()) + ids(2 + i % 7, start=100 * (i + 1)) for i in range(30)]
    requests = [(0.4 * i, 16 * len(chain) + 3, 2, chain) for i, chain in enumerate(chains)]
    truth = ClusterOverheads(prefill_coefficients=(0.01, 1e-3, 0.0, 0.0, 1e-5), reuse_load_s_per_token=3e-4,
                             first_token_delay_s=0.004)
    records = run(trace(*requests), truth, prefill=small_device)
    reused = [r for r in records if r.cached_tokens]
    assert {r.loaded_cached_tokens for r in reused} == {0, 96}  # in place, or all six blocks copied in
    for r in records:
        n, p = r.prompt_len - r.cached_tokens, r.cached_tokens
        worker_s = 0.01 + 1e-3 * n + 1e-5 * p + 3e-4 * r.loaded_cached_tokens
        assert r.prefill_worker_s == pytest.approx(worker_s)
        assert r.ttft_s == pytest.approx(worker_s + 0.004)  # the worker was idle: no queue
    got = fit_overheads(records, COSTS).overheads
    assert got.reuse_load_s_per_token == pytest.approx(3e-4, rel=1e-6)
    assert got.prefill_coefficients == pytest.approx(truth.prefill_coefficients, rel=1e-6, abs=1e-12)
    assert got.first_token_delay_s == pytest.approx(0.004)


def test_prefill_times_are_drawn_around_the_fit_with_the_live_spread() -> None:
    # 40 cold prefills of 3..9 blocks, 0.5 s apart (the worker idle before each).
    requests = [(0.5 * i, 16 * (3 + i % 7) + 3, 2, ids(3 + i % 7, start=100 * (i + 1))) for i in range(40)]
    plain = ClusterOverheads(prefill_coefficients=(0.01, 1e-3, 0.0, 0.0, 0.0))
    noisy = dataclasses.replace(plain, prefill_ratio_quantiles=(0.5, 0.8, 1.0, 1.2, 2.5))
    exact = {r.index: r.prefill_worker_s for r in run(trace(*requests), plain)}
    drawn = run(trace(*requests), noisy)
    ratios = [r.prefill_worker_s / exact[r.index] for r in drawn]
    assert min(ratios) >= 0.5 - 1e-9 and max(ratios) <= 2.5 + 1e-9 and len({round(x, 6) for x in ratios}) > 30
    assert [r.prefill_worker_s for r in run(trace(*requests), noisy)] == [r.prefill_worker_s for r in drawn]
    assert [r.prefill_worker_s for r in run(trace(*requests), noisy, seed=1)] != [r.prefill_worker_s for r in drawn]
    # The fit finds the formula again and the ratios' spread around it, at a mean of 1.
    got = fit_overheads(drawn, COSTS).overheads
    q = got.prefill_ratio_quantiles
    assert len(q) == 20 and np.mean(q) == pytest.approx(1.0, abs=0.05) and q[0] < 0.7 and q[-1] > 1.5
    exact_fit = fit_overheads(run(trace(*requests), plain), COSTS).overheads
    assert exact_fit.prefill_ratio_quantiles == pytest.approx((1.0,) * 20)


@pytest.mark.parametrize("num_long", [9, 10])
def test_the_curvature_terms_need_enough_long_prefills(num_long) -> None:
    # Prefills of 70..250 tokens, then num_long of 1,000..1,450, with a true n*n term: it is
    # recovered with MIN_LONG_PREFILLS (10) long ones and left at 0 with fewer.
    sizes = [5 + i % 12 for i in range(30)] + [63 + 3 * i for i in range(num_long)]
    scaled = trace(*[(3.0 * i, 16 * n, 1, ids(n, start=100 * i)) for i, n in enumerate(sizes)])
    truth = ClusterOverheads(prefill_coefficients=(0.02, 8e-4, 0.0, 5e-8, 0.0))
    got = fit_overheads(run(scaled, truth), COSTS).overheads.prefill_coefficients
    if num_long >= 10:
        assert got == pytest.approx(truth.prefill_coefficients, rel=1e-6, abs=1e-12)
    else:
        assert got[2] == got[3] == 0.0 and got[1] > truth.prefill_coefficients[1]  # the slope takes it
