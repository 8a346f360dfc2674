"""The simulator against figures computed independently from the trace: the infinite-cache
and LRU prefix hit ratios of the Mooncake synthetic trace, FAST'25 Figure 5's policy
ordering, and the oscillation of plain early rejection that prediction-based early rejection
damps. Every run uses analytic cost models (exact, machine-independent)."""

from __future__ import annotations

import statistics
from collections import OrderedDict

import pytest

from conductor.config import ConductorConfig
from costmodel import CostModels
from decode_worker.config import DecodeConfig
from prefill_worker.config import PrefillConfig
from replay.sim.run import SimConfig, SimResult, simulate
from replay.traces import SYNTHETIC_TRACE, read_trace
from replay.transform import TraceTransform, apply_transform

# shared/ lies beside the clone (here and in CI)
TRACE = SYNTHETIC_TRACE

BLOCK = 512  # one cluster block per trace block: the trace's own granularity
KV_BYTES, SNAPSHOT_BYTES = 1280, 300_000
BLOCK_BYTES = BLOCK * KV_BYTES + SNAPSHOT_BYTES  # every block carries a snapshot (interval 1)
UNBOUNDED = ConductorConfig(policy="cache_aware", max_running=10**6, max_queued=10**6, ttft_slo_s=1e9, tbt_slo_s=1e9)
BIG_DECODE = DecodeConfig(num_pages=10**7, num_slots=10**5, max_batch=10**4)


def costs(prefill_s_per_token: float, decode_s_per_request: float = 5e-4) -> CostModels:
    return CostModels.analytic(prefill_s_per_token=prefill_s_per_token, decode_base_s=0.02,
                               decode_s_per_request=decode_s_per_request, kv_bytes_per_token=KV_BYTES,
                               snapshot_bytes=SNAPSHOT_BYTES, transfer_bytes_per_s=5e9)


def scaled(rate_scale: float, num_requests: int | None = None, **slo):
    t = TraceTransform(block_size=BLOCK, max_prompt_tokens=10**7, rate_scale=rate_scale, index_end=num_requests,
                       **slo)
    return apply_transform(read_trace(TRACE), t, materialise=False)


def lru_reference(capacity_blocks: float) -> float:
    """Prefix hits of the trace's blocks, in arrival order, against one LRU pool of full blocks
    (a block counts when its whole chain is held; partial last blocks are never stored, as in
    the cluster): the trace README's figure, computed the cluster's way."""
    pool: OrderedDict = OrderedDict()
    hits = total = 0
    for r in sorted(read_trace(TRACE).requests, key=lambda r: r.arrival_s):
        chain = [tuple(r.hash_ids[: i + 1]) for i in range(len(r.hash_ids))]
        k = 0
        while k < len(chain) and chain[k] in pool:
            k += 1
        hits, total = hits + k, total + len(chain)
        for key in chain[:k]:
            pool.move_to_end(key)
        for key in chain[k: r.input_len // BLOCK]:
            pool[key] = True
            while len(pool) > capacity_blocks:
                pool.popitem(last=False)
    return hits / total


def one_worker(dram_blocks: float) -> SimResult:
    # Prefills of ~15 microseconds at a hundredth of the trace's rate: requests never overlap,
    # so "seen before" means "stored before", as in the reference.
    config = SimConfig(1, 1, UNBOUNDED, PrefillConfig(device_bytes=0, dram_bytes=int(dram_blocks * BLOCK_BYTES),
                                                      ssd_bytes=0, snapshot_interval_blocks=1), BIG_DECODE)
    return simulate(scaled(0.01), config, costs(1e-9))


def test_unbounded_cache_reproduces_the_infinite_cache_hit_ratio() -> None:
    result = one_worker(1e9)
    ratio = result.stats["prefix_hit_ratio_blocks"]
    assert ratio == pytest.approx(lru_reference(float("inf")), abs=1e-12)
    assert ratio == pytest.approx(0.640, abs=0.005)  # the README's figure (it also counts partial last blocks)
    assert result.summary.counts.finished == 3993


@pytest.mark.parametrize(("capacity", "readme"), [(1_000, 0.082), (10_000, 0.423)])
def test_a_bounded_lru_pool_reproduces_the_readme_figures(capacity: int, readme: float) -> None:
    ratio = one_worker(capacity).stats["prefix_hit_ratio_blocks"]
    assert ratio == pytest.approx(lru_reference(capacity), abs=1e-12)
    assert ratio == pytest.approx(readme, abs=0.015)


def test_fast25_figure5_ordering_of_average_ttft() -> None:
    # 8 + 8 workers, 10k prefill tokens/s each: the trace's rate loads the prefill pool enough
    # that placement matters. The baselines reuse only their own prefix (FAST'25's "local").
    trace = scaled(1.0, 2000)
    mean_ttft = {}
    for policy in ("random", "least_loaded", "cache_aware", "mooncake"):
        conductor = ConductorConfig(policy=policy, pull_from_peers=policy == "mooncake", max_running=10**6,
                                    max_queued=10**6, ttft_slo_s=1e9, tbt_slo_s=1e9)
        config = SimConfig(8, 8, conductor, PrefillConfig(dram_bytes=10**13, ssd_bytes=0), BIG_DECODE)
        mean_ttft[policy] = simulate(trace, config, costs(1e-4)).summary.ttft_s.mean
    assert mean_ttft["random"] > mean_ttft["least_loaded"] > mean_ttft["cache_aware"] > mean_ttft["mooncake"], mean_ttft


def test_prediction_based_early_rejection_damps_the_oscillation() -> None:
    # Decode is the bottleneck (2 workers, 4 ms per request in a step, TBT SLO 0.2 s) at three
    # times the trace's rate; plain early rejection admits on the decode load it sees now.
    trace = scaled(3.0, ttft_slo_s=30.0, tbt_slo_s=0.2)
    runs = {}
    for mode in ("early", "predictive"):
        conductor = ConductorConfig(policy="mooncake", admission_mode=mode, max_running=10**6, max_queued=10**6)
        config = SimConfig(8, 2, conductor, PrefillConfig(dram_bytes=10**13, ssd_bytes=0), BIG_DECODE)
        runs[mode] = simulate(trace, config, costs(1e-4, decode_s_per_request=0.004))
    decode_var = {m: statistics.pvariance([d for _, _, d, _ in r.stats["load"]]) for m, r in runs.items()}
    prefill_var = {m: statistics.pvariance([p for _, p, _, _ in r.stats["load"]]) for m, r in runs.items()}
    early, predictive = runs["early"].summary, runs["predictive"].summary
    assert decode_var["predictive"] < 0.5 * decode_var["early"], decode_var
    assert prefill_var["predictive"] < 0.5 * prefill_var["early"], prefill_var
    assert predictive.counts.rejected < early.counts.rejected
    assert predictive.slo.goodput_rps >= early.slo.goodput_rps
