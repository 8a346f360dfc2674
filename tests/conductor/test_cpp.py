"""A chunked-pipeline (CPP) prefill group as one schedulable unit (``conductor/cpp.py``): the
threshold on prompt length that the cost model gives, the per-request choice every policy's
decision carries, the mooncake policy preferring the group for long prompts only, and the
simulator modelling the group with the same rule."""

from __future__ import annotations

import dataclasses

import pytest

from conductor import cpp
from conductor.config import ConductorConfig
from conductor.routing import ClusterSnapshot, PolicyContext, RouteDecision, RouteRequest, WorkerView, make_policy
from costmodel.builtin import tiny_cpu_estimate
from decode_worker.config import DecodeConfig
from prefill_worker.config import PrefillConfig
from replay.sim.run import SimConfig, simulate
from replay.transform import ReplayRequest, ScaledTrace, TraceTransform

COSTS = tiny_cpu_estimate()
BLOCK = 32
CHUNK = 1024


def _views(*, cpp_stages: int = 2) -> ClusterSnapshot:
    prefill = (WorkerView("cpp-0", "prefill", "rpc-a", "tcp://a", num_free_pages=4096, cpp_stages=cpp_stages,
                          cpp_chunk_tokens=CHUNK),
               WorkerView("plain-1", "prefill", "rpc-b", "tcp://b", num_free_pages=4096))
    decode = (WorkerView("decode-0", "decode", "rpc-d", "tcp://d", num_free_pages=100_000),)
    return ClusterSnapshot(prefill, decode, 0.0)


def _request(n: int, seq: int = 0) -> RouteRequest:
    return RouteRequest(f"r{n}-{seq}", seq, n, n // BLOCK, 16, BLOCK)


def test_the_cost_model_gives_a_threshold_on_prompt_length():
    threshold = cpp.threshold_tokens(COSTS, 2, CHUNK)
    assert CHUNK < threshold < 8 * CHUNK, threshold
    assert cpp.pipeline_chunk_tokens(COSTS, 2, CHUNK, threshold) == CHUNK
    assert cpp.pipeline_chunk_tokens(COSTS, 2, CHUNK, threshold - 1) == 0
    assert all(cpp.pipeline_chunk_tokens(COSTS, 2, CHUNK, n) == CHUNK for n in (threshold, 16_384, 100_000))
    assert cpp.pipeline_chunk_tokens(COSTS, 1, CHUNK, 16_384) == 0  # not a pipeline
    # Long prompts approach 1/S of the single time; one chunk costs a little more than single.
    single = COSTS.prefill_s(16_384, 0)
    piped = cpp.pipelined_from(single, COSTS.prefill_const_s, 16_384, 2, CHUNK)
    assert 0.5 * single < piped < 0.6 * single
    assert cpp.one_chunk_from(single, 2) > single
    # Without cost models, a prompt of two chunks or more.
    assert cpp.pipeline_chunk_tokens(None, 2, CHUNK, 2 * CHUNK) == CHUNK
    assert cpp.pipeline_chunk_tokens(None, 2, CHUNK, 2 * CHUNK - 1) == 0


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "cache_aware", "kv_cost", "mooncake"])
def test_every_policy_decides_the_pipeline_for_a_cpp_group(policy):
    """Whichever prefill worker a policy picks, the decision pipelines a long prompt on a CPP
    group and never on a plain worker or for a short prompt."""
    pick = make_policy(policy, PolicyContext(ConductorConfig().routing, COSTS))
    threshold = cpp.threshold_tokens(COSTS, 2, CHUNK)
    for n in (200, threshold + 500, 12_000):
        for seq in range(2):
            decision = pick(_views(), _request(n, seq))
            assert isinstance(decision, RouteDecision)
            want = CHUNK if decision.prefill_worker == "cpp-0" and n >= threshold else 0
            assert decision.cpp_chunk_tokens == want, (policy, n, decision)


def test_mooncake_sends_long_prompts_to_the_group_and_short_ones_elsewhere():
    pick = make_policy("mooncake", PolicyContext(ConductorConfig().routing, COSTS))
    long_decision = pick(_views(), _request(12_000))
    short_decision = pick(_views(), _request(300))
    assert long_decision.prefill_worker == "cpp-0" and long_decision.cpp_chunk_tokens == CHUNK
    single = COSTS.prefill_s(12_000, 0)
    assert long_decision.predicted.prefill_s == pytest.approx(
        cpp.pipelined_from(single, COSTS.prefill_const_s, 12_000, 2, CHUNK))
    assert short_decision.prefill_worker == "plain-1" and short_decision.cpp_chunk_tokens == 0
    # The group's queue counts its jobs at the group's speed: with a long job queued there, a
    # second long prompt still prefers it only while that beats the plain worker's single time.
    busy = dataclasses.replace(_views(), prefill=(
        dataclasses.replace(_views().prefill[0], prefill_jobs=(long_job(),)), _views().prefill[1]))
    assert pick(busy, _request(12_000)).prefill_worker == "plain-1"


def long_job():
    from clusterstate.workers import PrefillJobLoad

    return PrefillJobLoad("queued", 40_000)


def _trace(lengths: list[int], gap_s: float) -> ScaledTrace:
    requests = tuple(ReplayRequest(f"t{i}", i, i * gap_s, n, 4, hash_ids=tuple(range(10**6 * (i + 1),
                                                                                       10**6 * (i + 1) + n // BLOCK)),
                                   tokens_per_block=BLOCK) for i, n in enumerate(lengths))
    return ScaledTrace(TraceTransform(block_size=BLOCK, trace_block_tokens=BLOCK), requests, "test", "test",
                       len(requests), 0.0, 0, 0)


def _ttfts(stages: int, lengths: list[int]) -> list[float]:
    conductor = ConductorConfig(policy="mooncake", max_running=10**4, max_queued=10**4, ttft_slo_s=1e9, tbt_slo_s=1e9)
    prefill = PrefillConfig(cpp_stages=stages, cpp_chunk_tokens=CHUNK, num_pages=4096)
    config = SimConfig(1, 1, conductor, prefill, DecodeConfig(num_pages=10**6))
    result = simulate(_trace(lengths, gap_s=30.0), config, COSTS)
    return [r.ttft_s for r in sorted(result.records, key=lambda r: r.request_id)]


def test_the_simulator_models_the_group_with_the_same_rule():
    """One CPP group of 2 stages against one plain worker, requests far apart (no queueing):
    long prompts' TTFT close to half, short ones' a hop longer (not pipelined)."""
    lengths = [16_384, 256, 8_192]
    plain, group = _ttfts(1, lengths), _ttfts(2, lengths)
    assert group[0] < 0.6 * plain[0] and group[2] < 0.65 * plain[2]
    assert plain[1] <= group[1] <= plain[1] + 2 * 2 * cpp.HOP_S + 1e-6
