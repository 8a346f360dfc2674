"""A simulated run that holds only what is in flight: records streamed to a report directory
give the same bytes and summary as the kept ones; a tiled trace runs copy after copy with
its own ids and keys, and the run's per-request state stays bounded by what is in flight;
the event loop's fed arrivals keep the queue's order; the key cache stays bounded. Analytic
cost models: every figure is the simulator's own arithmetic."""

from __future__ import annotations

import json

import pytest

from conductor.config import ConductorConfig
from costmodel import CostModels
from decode_worker.config import DecodeConfig
from prefill_worker.config import PrefillConfig
from replay.records import RequestRecord
from replay.report import REQUESTS_FILE, SUMMARY_FILE, ReportWriter, write_report
from replay.sim.events import EventLoop
from replay.sim.keys import KeyCache
from replay.sim.run import SimConfig, Simulation, simulate
from replay.summary import Summary
from replay.traces import SYNTHETIC_TRACE, read_trace
from replay.transform import ReplayRequest, ScaledTrace, TiledTrace, TraceTransform, apply_transform

COSTS = CostModels.analytic(prefill_s_per_token=1e-4, decode_base_s=0.02, decode_s_per_request=5e-4,
                            kv_bytes_per_token=1280, snapshot_bytes=300_000, transfer_bytes_per_s=5e9)
OPEN = ConductorConfig(max_running=10**6, max_queued=10**6)
CONFIG = SimConfig(2, 2, OPEN, PrefillConfig(device_bytes=1 << 30, dram_bytes=4 << 30, ssd_bytes=0),
                   DecodeConfig(num_pages=10**6, num_slots=1000, max_batch=256))


def window(num_requests: int, rate_scale: float = 1.0, **slo: float):
    t = TraceTransform(block_size=512, max_prompt_tokens=10**7, rate_scale=rate_scale, index_end=num_requests, **slo)
    return apply_transform(read_trace(SYNTHETIC_TRACE), t, materialise=False)


def test_streamed_records_and_summary_are_the_kept_ones(tmp_path) -> None:
    trace = window(300, ttft_slo_s=2.0, tbt_slo_s=0.1)
    kept = simulate(trace, CONFIG, COSTS)
    assert kept.summary.counts.rejected > 0 and kept.summary.counts.finished > 0  # both kinds of record
    write_report(tmp_path / "kept", kept.records, kept.summary, plots=False)
    writer = ReportWriter(tmp_path / "streamed", batch_records=7)
    streamed = simulate(trace, CONFIG, COSTS, sink=writer)
    assert streamed.records == ()
    assert (tmp_path / "streamed" / REQUESTS_FILE).read_bytes() == (tmp_path / "kept" / REQUESTS_FILE).read_bytes()
    on_disk, kept_dict = json.loads((tmp_path / "streamed" / SUMMARY_FILE).read_text()), kept.summary.to_dict()
    for d in (on_disk, kept_dict):
        d["run"]["simulator"].pop("wall_s")  # the one figure of the host, not of the run
    assert on_disk == json.loads(json.dumps(kept_dict))
    assert streamed.summary.cache == kept.summary.cache and streamed.summary.ttft_s == kept.summary.ttft_s


def test_a_streaming_sink_refuses_records_out_of_index_order(tmp_path) -> None:
    writer = ReportWriter(tmp_path)
    rec = RequestRecord(request_id="t5", index=5, source="simulated", outcome="rejected", scheduled_s=0.0,
                        arrival_s=0.0, prompt_len=1, max_tokens=1)
    writer.add(rec)
    with pytest.raises(ValueError, match="index order, got index 3 after 5"):
        writer.add(RequestRecord(**{**rec.to_dict(), "index": 3}))
    writer.close()


class _Watch:
    """A sink that notes how many requests the simulation holds each time a record comes."""

    in_index_order = True

    def __init__(self) -> None:
        self.sim: Simulation | None = None
        self.records: list[RequestRecord] = []
        self.max_lives = 0

    def add(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.max_lives = max(self.max_lives, len(self.sim.lives))

    def finish(self, *, trace: dict, run: dict) -> Summary:
        from replay.summary import summarize

        return summarize(self.records, trace=trace, run=run)


def shared_prefixes(num_requests: int) -> ScaledTrace:
    """Requests 0.1 s apart, 16-token blocks: a 12-block prefix shared by all, then 4 of their own."""
    reqs = tuple(ReplayRequest(f"t{i}", i, 0.1 * i, 16 * 16, 20, tokens_per_block=16,
                               hash_ids=(*range(12), *range(100 + 4 * i, 104 + 4 * i))) for i in range(num_requests))
    return ScaledTrace(TraceTransform(trace_block_tokens=16, block_size=16), reqs, "test", "mooncake", num_requests,
                       0.0, 0, 0)


def test_a_tiled_trace_runs_its_copies_apart_in_bounded_state() -> None:
    base = shared_prefixes(120)
    tiled = TiledTrace(base, copies=4, period_s=1000.0)  # each copy long done before the next
    assert tiled.num_requests == 480
    watch = _Watch()
    # One prefill worker, no SLO to miss: what a request reuses depends only on its own copy.
    one = SimConfig(1, 2, ConductorConfig(max_running=10**6, max_queued=10**6, ttft_slo_s=1e9, tbt_slo_s=1e9),
                    CONFIG.prefill, CONFIG.decode)
    sim = Simulation(tiled, one, COSTS, sink=watch)
    watch.sim = sim
    result = sim.run()
    recs = watch.records
    assert [r.index for r in recs] == [i * base.num_in_trace + r.index for i in range(4) for r in base.requests]
    assert len({r.request_id for r in recs}) == 480 and result.summary.counts.total == 480
    assert watch.max_lives < 20  # what is in flight (a few), never the run (480)
    assert not sim.lives
    # No copy reuses another's blocks: each reuses exactly what the first did.
    first = recs[:120]
    assert result.summary.counts.finished == 480 and sum(r.cached_tokens for r in first) > 0
    for i in range(1, 4):
        copy = recs[i * 120:(i + 1) * 120]
        assert [r.cached_tokens for r in copy] == [r.cached_tokens for r in first]
        assert [r.arrival_s for r in copy] == pytest.approx([r.arrival_s + i * 1000.0 for r in first])
    assert result.summary.cache.cached_tokens == 4 * sum(r.cached_tokens for r in first)
    ids = [set(r.hash_ids) for r in TiledTrace(base, 2).requests]
    assert not set().union(*ids[:120]) & set().union(*ids[120:])


def test_tiling_needs_hash_ids() -> None:
    t = TraceTransform(block_size=16, max_prompt_tokens=64, index_end=3)
    with pytest.raises(ValueError, match="hash ids"):
        TiledTrace(apply_transform(read_trace(SYNTHETIC_TRACE), t, materialise=True), 2)


def test_fed_events_run_before_queued_ones_of_the_same_time_and_in_time_order() -> None:
    loop, seen = EventLoop(), []
    loop.at(1.0, seen.append, "queued at 1")
    loop.at(0.5, seen.append, "queued at 0.5")
    loop.feed(iter([(0.5, seen.append, ("fed at 0.5",)), (1.0, seen.append, ("fed at 1",)),
                    (2.0, seen.append, ("fed at 2",))]))
    loop.run()
    assert seen == ["fed at 0.5", "queued at 0.5", "fed at 1", "queued at 1", "fed at 2"]
    assert loop.now == 2.0 and loop.num_events == 5
    back = EventLoop()
    back.feed(iter([(1.0, seen.append, ("a",)), (0.5, seen.append, ("b",))]))
    with pytest.raises(ValueError, match="time order"):
        back.run()


def test_the_key_cache_is_bounded_and_its_keys_do_not_depend_on_it() -> None:
    small, big = KeyCache(max_keys=4), KeyCache()
    chains = [(1, 2, 3, 4, 5), (1, 2, 9), (7, 8, 9, 10), (1, 2, 3, 4, 5, 6)]
    for ids in chains * 3:
        assert small.chain(ids, len(ids) * 2, 2, "acme") == big.chain(ids, len(ids) * 2, 2, "acme")
        assert len(small) <= 2 * (4 + 12)  # two generations of at most max_keys + one chain (12 blocks)
    assert small.chain((1, 2), 4, 2) != small.chain((1, 2), 4, 2, "acme")  # the tenant is in the key


def test_tiled_copies_may_not_overlap() -> None:
    base = shared_prefixes(10)  # arrivals 0 .. 0.9 s
    with pytest.raises(ValueError, match="span"):
        TiledTrace(base, 2, period_s=0.5)
    assert [r.arrival_s for r in TiledTrace(base, 2).requests][10] == pytest.approx(1.9)  # default: last + 1 s
