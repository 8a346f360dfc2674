"""Exact statistics: Mooncake TBT of hand-made timelines, percentiles, SLO goodput, summaries, timelines."""

import numpy as np
import pytest

from replay.stats import (
    LatencyStats,
    interval_array,
    mean_itl_s,
    meets_slo,
    percentile,
    tbt_of_intervals,
    tbt_s,
    token_intervals,
)
from replay.summary import Summary, summarize
from replay.timeline import admissions_over_time, cached_ratio_over_time, concurrency, worker_occupancy
from tests.replay.helpers import rec


def times_from_gaps(first: float, gaps) -> list[float]:
    out = [first]
    for g in gaps:
        out.append(out[-1] + g)
    return out


def test_tbt_is_mean_of_longest_tenth_of_intervals():
    assert token_intervals([1.0, 1.5, 3.0]) == [0.5, 1.5]
    assert tbt_s([1.0, 1.1, 1.2, 1.5, 1.6]) == pytest.approx(0.3)  # 4 gaps -> the longest 1
    assert tbt_s(times_from_gaps(2.0, range(1, 21))) == pytest.approx(19.5)  # 20 gaps -> mean of 19, 20
    assert tbt_s(times_from_gaps(0.0, [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 5, 7])) == pytest.approx(6.0)  # 12 -> 2
    assert tbt_s(times_from_gaps(0.0, [2] * 10)) == pytest.approx(2.0)
    assert tbt_s([0.3]) is None and tbt_s([]) is None
    # tokens delivered in one message share a time: zero gaps count as intervals
    assert tbt_s([0.1, 0.1, 0.1, 0.4]) == pytest.approx(0.3)
    assert mean_itl_s([0.1, 0.1, 0.1, 0.4]) == pytest.approx(0.1)
    assert mean_itl_s([0.1]) is None


def test_the_array_of_intervals_and_its_tbt_equal_the_lists_bit_for_bit():
    """The summary takes the gaps as an array (numpy's subtractions) and sorts them with numpy:
    the same floats as the plain list and ``sorted``, so its TBT figures are unchanged."""
    rng = np.random.default_rng(7)
    for n in (0, 1, 2, 11, 340, 2049):
        times = [float(t) for t in np.cumsum(rng.exponential(0.02, n)) + 3.7]
        gaps = interval_array(times)
        assert gaps.dtype == np.float64 and gaps.tolist() == token_intervals(times)
        expected = float(np.mean(sorted(token_intervals(times))[-max(1, -(-len(gaps) // 10)):])) if n > 1 else None
        assert tbt_of_intervals(gaps) == tbt_of_intervals(token_intervals(times)) == expected


def test_percentiles_and_latency_stats():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) is None
    with pytest.raises(ValueError, match=r"q must be in \[0, 100\]"):
        percentile([1], 101)
    s = LatencyStats.of(list(range(1, 101)))
    assert (s.count, s.mean, s.p50, s.p90, s.p99, s.max) == (100, 50.5, 50.5, pytest.approx(90.1), 99.01, 100)
    assert LatencyStats.of([]) == LatencyStats(0, None, None, None, None, None)


def test_meets_slo():
    assert meets_slo(0.5, 0.1, 0.5, 0.1) and meets_slo(0.5, None, 0.5, 0.1) and meets_slo(9.0, 9.0, None, None)
    assert not meets_slo(0.51, 0.1, 0.5, 0.1) and not meets_slo(0.1, 0.2, 0.5, 0.1)
    assert not meets_slo(None, None, None, None)


def hand_made():
    return [
        rec(0, arrival=0.0, ttft=0.2, gaps=(0.1, 0.1), prompt=100, cached=0, ttft_slo_s=0.5, tbt_slo_s=0.15),
        rec(1, arrival=1.0, ttft=0.4, gaps=(0.1, 0.3), prompt=200, cached=160, ttft_slo_s=0.5, tbt_slo_s=0.15),
        rec(2, arrival=2.0, ttft=0.9, gaps=(0.1,), prompt=100, cached=80, prefill="prefill-1", ttft_slo_s=0.5),
        rec(3, arrival=3.0, ttft=0.3, gaps=(), prompt=100, cached=0, decode="decode-1"),  # no SLO: not judged
        rec(4, "rejected", arrival=3.5, retry_after_s=1.0, ttft_slo_s=0.5),
        rec(5, "failed", arrival=4.0, error="boom"),
    ]


def test_summary_of_hand_made_records():
    s = summarize(hand_made(), trace={"source": "x"}, run={"endpoint": "e"})
    assert (s.counts.total, s.counts.finished, s.counts.rejected, s.counts.failed, s.counts.cancelled) == \
        (6, 4, 1, 1, 0)
    assert s.duration_s == pytest.approx(4.01)  # the failed record ends at 4.0 + 0.01
    assert s.ttft_s.count == 4 and s.ttft_s.p50 == pytest.approx(0.35) and s.ttft_s.max == pytest.approx(0.9)
    assert s.tbt_s.count == 3 and s.tbt_s.max == pytest.approx(0.3)  # per request: 0.1, 0.3, 0.1
    assert s.itl_s.count == 5 and s.itl_s.p50 == pytest.approx(0.1)
    # judged: #0, #1, #2, #4 (#3 and #5 carry no SLO). Met: #0 (0.2 <= 0.5, tbt 0.1 <= 0.15);
    # #1 misses TBT, #2 misses TTFT, #4 was rejected
    assert s.slo.num_met == 1 and s.slo.num_with_slo == 4
    assert s.slo.attainment == pytest.approx(1 / 4) and s.slo.goodput_rps == pytest.approx(1 / 4.01)
    assert (s.cache.prompt_tokens, s.cache.cached_tokens, s.cache.ratio) == (500, 240, pytest.approx(0.48))
    assert s.workers["prefill"] == {"prefill-0": {"requests": 4, "prompt_tokens": 500, "cached_tokens": 160},
                                    "prefill-1": {"requests": 1, "prompt_tokens": 100, "cached_tokens": 80}}
    assert s.workers["decode"] == {"decode-0": {"requests": 3, "output_tokens": 8},
                                   "decode-1": {"requests": 1, "output_tokens": 1}}
    assert s.source == "live" and s.run == {"endpoint": "e"}
    assert Summary.from_dict(s.to_dict()) == s
    flat = s.flatten()
    assert flat["ttft_s.p50"] == pytest.approx(0.35) and flat["workers.prefill.prefill-1.requests"] == 1
    assert "trace" not in str(flat.keys()) and "schema_version" not in flat


def test_summary_source_and_empty():
    assert summarize([rec(0, source="simulated")]).source == "simulated"
    assert summarize([rec(0), rec(1, source="simulated")]).source == "mixed"
    s = summarize([])
    assert s.counts.total == 0 and s.duration_s == 0.0 and s.cache.ratio == 0.0
    assert s.slo.goodput_rps is None and s.slo.attainment is None


def test_without_any_slo_there_is_no_attainment_or_goodput():
    # 19 of 20 finished and none carries an SLO: nothing was judged, so there is no 0.95 to report
    s = summarize([rec(i, arrival=float(i)) for i in range(19)] + [rec(19, "rejected", arrival=19.0)])
    assert (s.slo.num_with_slo, s.slo.num_met, s.slo.attainment, s.slo.goodput_rps) == (0, 0, None, None)
    assert Summary.from_dict(s.to_dict()) == s and "slo.attainment" not in s.flatten()
    from replay.cli import summary_text

    assert "no request has an SLO" in summary_text(s) and "0.950" not in summary_text(s)


def test_concurrency_of_intervals():
    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0])
    assert concurrency([(0.0, 1.0), (0.5, 2.0), (1.0, 1.5)], grid).tolist() == [1, 2, 2, 1, 0, 0]
    assert concurrency([], grid).tolist() == [0] * 6


def test_worker_occupancy_from_request_intervals():
    records = [rec(0, arrival=0.0, ttft=1.0, gaps=(1.0,), queue=0.5),  # queued [0,.5) prefill [.5,1) decode [1,2)
               rec(1, arrival=0.5, ttft=1.0, gaps=(0.5,), prefill="prefill-1"),
               rec(2, "rejected", arrival=0.2)]
    grid = np.array([0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 1.75, 2.0])
    occ = {(o.role, o.worker): o for o in worker_occupancy(records, grid)}
    assert list(occ) == [("prefill", "prefill-0"), ("prefill", "prefill-1"), ("decode", "decode-0")]
    assert occ["prefill", "prefill-0"].queued.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert occ["prefill", "prefill-0"].running.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert occ["prefill", "prefill-1"].running.tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    assert occ["decode", "decode-0"].running.tolist() == [0, 0, 0, 0, 1, 2, 2, 0]


def test_admissions_and_cached_ratio_over_time():
    records = [rec(0, arrival=0.1, ttft=0.1, gaps=(), prompt=100, cached=50),
               rec(1, "rejected", arrival=0.2), rec(2, "rejected", arrival=1.2),
               rec(3, arrival=1.5, ttft=0.1, gaps=(), prompt=100, cached=0)]
    edges, admitted, rejected = admissions_over_time(records, bin_s=1.0)
    assert edges.tolist() == [0.0, 1.0, 2.0] and admitted.tolist() == [1, 1, 0] and rejected.tolist() == [1, 1, 0]
    edges, per_bin, cumulative = cached_ratio_over_time(records, bin_s=1.0)
    assert per_bin[:2].tolist() == [0.5, 0.0] and np.isnan(per_bin[2])
    assert cumulative.tolist() == [0.5, 0.25, 0.25]
