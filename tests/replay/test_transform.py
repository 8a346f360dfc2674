"""Selection, time/length/output scaling and SLO defaults of ``apply_transform``: exact numbers."""

import pytest

from replay.tokens import prompt_tokens
from replay.traces import Trace, TraceRequest
from replay.transform import (
    ReplayRequest,
    TraceTransform,
    apply_transform,
    scaled_output_len,
    scaled_prompt_len,
    select,
)


def chain(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def trace_of(*requests: TraceRequest) -> Trace:
    return Trace(requests=tuple(requests), format="mooncake", source="mem")


def test_default_length_scale_maps_each_trace_block_to_whole_cluster_blocks():
    r = TraceRequest(0, 0.0, 40160, 6, hash_ids=chain(79))  # 78 full blocks + 224 tokens
    one = TraceTransform(block_size=16, blocks_per_trace_block=1)
    assert one.tokens_per_trace_block == 16 and one.effective_length_scale == 16 / 512
    assert scaled_prompt_len(r, one) == 78 * 16 + 7  # 224 * 16/512 = 7 tokens of the last block
    two = TraceTransform(block_size=16, blocks_per_trace_block=2)
    assert scaled_prompt_len(r, two) == 78 * 32 + 14
    (out,) = apply_transform(trace_of(r), two).requests
    assert out.prompt_ids == prompt_tokens(r.hash_ids, 2510, 32)
    assert (out.prompt_len, out.hash_ids, out.tokens_per_block) == (2510, r.hash_ids, 32)
    (lean,) = apply_transform(trace_of(r), two, materialise=False).requests
    assert lean.prompt_ids == () and lean == ReplayRequest(**{**out.__dict__, "prompt_ids": ()})


def test_smaller_length_scale_keeps_a_prefix_of_the_chain():
    r = TraceRequest(0, 0.0, 40160, 6, hash_ids=chain(79))
    t = TraceTransform(block_size=16, length_scale=1 / 128)
    (out,) = apply_transform(trace_of(r), t).requests
    assert out.prompt_len == 314  # ceil(40160 / 128 = 313.75)
    assert out.hash_ids == r.hash_ids[:20] and out.prompt_ids == prompt_tokens(r.hash_ids[:20], 314, 16)
    tenth = TraceTransform(blocks_per_trace_block=4, length_scale=0.1)
    assert scaled_prompt_len(TraceRequest(0, 0.0, 30, 1, hash_ids=(0,)), tenth) == 3  # 30 * 0.1, no float noise
    with pytest.raises(ValueError, match="length_scale 0.1 exceeds 0.03125"):
        TraceTransform(length_scale=0.1, block_size=16)


def test_output_scale_and_clamps():
    t = TraceTransform(output_scale=0.05, max_output_tokens=8)
    assert [scaled_output_len(n, t) for n in (149, 0, 1, 20, 160, 161, 1000)] == [8, 1, 1, 1, 8, 8, 8]
    assert scaled_output_len(30, TraceTransform(output_scale=0.1)) == 3  # no float-noise extra token
    trace = trace_of(TraceRequest(0, 0.0, 10, 0, hash_ids=(0,)), TraceRequest(1, 0.0, 10, 500, hash_ids=(1,)),
                     TraceRequest(2, 0.0, 10, 5, hash_ids=(2,)))
    s = apply_transform(trace, TraceTransform(max_output_tokens=100, length_scale=1 / 512 * 16))
    assert [r.max_tokens for r in s.requests] == [1, 100, 5] and s.num_outputs_clamped == 2


def test_max_prompt_tokens_cuts_and_counts():
    trace = trace_of(TraceRequest(0, 0.0, 512 * 10, 1, hash_ids=chain(10)),
                     TraceRequest(1, 1.0, 5, 1, prompt_ids=(5, 6, 7, 8, 9)))
    s = apply_transform(trace, TraceTransform(max_prompt_tokens=100))
    assert [r.prompt_len for r in s.requests] == [100, 5] and s.num_prompts_cut == 1
    s = apply_transform(trace, TraceTransform(max_prompt_tokens=3))
    assert s.requests[1].prompt_ids == (5, 6, 7) and s.num_prompts_cut == 2
    assert s.requests[1].hash_ids == () and s.requests[0].hash_ids == (0,)
    bad = trace_of(TraceRequest(4, 0.0, 2, 1, prompt_ids=(1, 9000)))
    with pytest.raises(ValueError, match=r"request 4: prompt token id 9000 outside the vocabulary \[0, 8192\)"):
        apply_transform(bad, TraceTransform())


def arrivals(*ts: float) -> Trace:
    return trace_of(*(TraceRequest(i, t, 10, 1, hash_ids=(i,)) for i, t in enumerate(ts)))


def test_rate_scale_and_offset():
    s = apply_transform(arrivals(10.0, 11.0, 14.0), TraceTransform(rate_scale=2.0))
    assert [r.arrival_s for r in s.requests] == [0.0, 0.5, 2.0]
    assert s.trace_offset_s == 10.0 and [r.request_id for r in s.requests] == ["t0", "t1", "t2"]
    s = apply_transform(arrivals(10.0, 11.0, 14.0), TraceTransform(rate_scale=0.5))
    assert [r.arrival_s for r in s.requests] == [0.0, 2.0, 8.0]


def test_window_then_index_range_then_sample():
    trace = arrivals(*[float(i) for i in range(20)])
    pick = lambda **kw: [r.index for r in select(trace.requests, TraceTransform(**kw))]  # noqa: E731
    assert pick(window_start_s=3.0, window_end_s=7.0) == [3, 4, 5, 6]  # half-open
    assert pick(window_start_s=17.5) == [18, 19]
    assert pick(window_end_s=2.0) == [0, 1]
    assert pick(index_end=3) == [0, 1, 2]
    assert pick(window_start_s=5.0, index_start=2, index_end=4) == [7, 8]
    a, b = pick(sample_n=5, sample_seed=1), pick(sample_n=5, sample_seed=1)
    assert a == b and len(a) == 5 and a == sorted(a) and len(set(a)) == 5
    assert pick(sample_n=5, sample_seed=2) != a
    assert pick(sample_n=50) == list(range(20))
    assert pick(window_start_s=10.0, sample_n=3, sample_seed=1) == sorted(pick(window_start_s=10.0, sample_n=3,
                                                                            sample_seed=1))
    assert all(i >= 10 for i in pick(window_start_s=10.0, sample_n=3, sample_seed=1))
    with pytest.raises(ValueError, match="keeps no request of the 20"):
        apply_transform(trace, TraceTransform(window_start_s=100.0))
    with pytest.raises(ValueError, match="window end 1.0s must be after its start 2.0s"):
        TraceTransform(window_start_s=2.0, window_end_s=1.0)


def test_unsorted_trace_is_replayed_in_arrival_order():
    s = apply_transform(arrivals(5.0, 1.0, 3.0), TraceTransform())
    assert [r.index for r in s.requests] == [1, 2, 0] and [r.arrival_s for r in s.requests] == [0.0, 2.0, 4.0]


def test_slo_defaults_fill_only_missing_slos():
    trace = trace_of(TraceRequest(0, 0.0, 10, 1, hash_ids=(0,), ttft_slo_s=0.5, tenant="a", request_id="x"),
                     TraceRequest(1, 0.0, 10, 1, hash_ids=(1,)))
    s = apply_transform(trace, TraceTransform(ttft_slo_s=2.0, tbt_slo_s=0.1))
    assert [(r.ttft_slo_s, r.tbt_slo_s) for r in s.requests] == [(0.5, 0.1), (2.0, 0.1)]
    assert (s.requests[0].request_id, s.requests[0].tenant) == ("x", "a")
    assert [(r.ttft_slo_s, r.tbt_slo_s) for r in apply_transform(trace, TraceTransform()).requests] == \
        [(0.5, None), (None, None)]


def test_transform_is_recorded_and_round_trips():
    t = TraceTransform(blocks_per_trace_block=2, length_scale=0.01, rate_scale=3.0, index_end=5, sample_n=2,
                       ttft_slo_s=1.0)
    s = apply_transform(arrivals(0.0, 1.0, 2.0, 3.0, 4.0, 5.0), t)
    d = s.describe()
    assert d["num_in_trace"] == 6 and d["num_selected"] == 2 and d["transform"]["rate_scale"] == 3.0
    assert TraceTransform.from_dict(d["transform"]) == t
    for bad in (dict(block_size=0), dict(rate_scale=0.0), dict(output_scale=-1.0), dict(sample_n=0)):
        with pytest.raises(ValueError):
            TraceTransform(**bad)
    with pytest.raises(ValueError, match="the trace has 512-token blocks, the transform says 256"):
        apply_transform(arrivals(0.0), TraceTransform(trace_block_tokens=256))
