"""Requests through their lifecycle in the simulator, in the live Conductor's order: admission,
``ConductorCore.route`` (the real policy on the real snapshot), reserve on the decode worker,
prefill (queued on the chosen worker, pulling the planned prefix), first token, decode in the
continuous batch, end. Each request ends in exactly one ``RequestRecord``.

``simulate(scaled, config, costs)`` is the entry point; ``SimConfig`` holds the cluster's
shape and every component's config (the same frozen configs the live processes parse), and
the live cluster's ``ClusterOverheads`` (none by default). The policies predict from
``costs`` alone, as the live Conductor does; the modelled workers take the overheads too, and
each prefill's worker time goes back to the core's ``WorkerSpeed`` exactly as a live Prefill
response does, so the Conductor's speed factors (and what they do to admission) follow.

A run holds only what is in flight: arrivals are read from the trace one at a time
(``EventLoop.feed``: a ``ScaledTrace``'s tuple, or any iterable of requests in arrival order
such as ``replay.transform.TiledTrace``), a request's state is dropped with its record, and
records go to a ``RecordSink`` as they are made. By default they are kept and returned,
sorted by index; ``simulate(..., sink=ReportWriter(out))`` streams them to a report
directory instead (in index order, which needs the requests' indexes to rise in arrival
order), with the summary built as they pass.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from conductor.config import ConductorConfig
from conductor.core import ConductorCore, RequestFacts
from conductor.routing import PolicyContext, Rejection, RouteDecision, make_policy
from costmodel import CostModels
from costmodel.overheads import ClusterOverheads
from decode_worker.config import DecodeConfig
from kvstore.blocks import chain_keys
from prefill_worker.config import PrefillConfig
from replay.records import FINISHED, REJECTED, RequestRecord
from replay.sim.cluster import FINGERPRINT, SimCluster
from replay.sim.decode import SimDecode, SimDecodeRequest
from replay.sim.events import EventLoop
from replay.sim.keys import KeyCache
from replay.sim.prefill import SimPrefill, SimPrefillJob
from replay.sim.sinks import InOrder, KeptRecords, RecordSink
from replay.summary import Summary
from replay.transform import ReplayRequest, ScaledTrace, TiledTrace


@dataclass(frozen=True)
class SimConfig:
    num_prefill: int = 1
    num_decode: int = 1
    conductor: ConductorConfig = field(default_factory=ConductorConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    load_sample_interval_s: float = 1.0  # how often the load series (stats["load"]) is sampled
    overheads: ClusterOverheads = field(default_factory=ClusterOverheads)  # what the live cluster adds
    seed: int = 0  # of the delivery delays, joins and prefill ratios (used only when overheads has them)

    def __post_init__(self) -> None:
        if self.load_sample_interval_s <= 0:
            raise ValueError(f"load_sample_interval_s {self.load_sample_interval_s} must be > 0")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"need at least one worker of each role, got {self.num_prefill} prefill and "
                             f"{self.num_decode} decode")

    def describe(self) -> dict:
        return {"num_prefill": self.num_prefill, "num_decode": self.num_decode, "policy": self.conductor.policy,
                "admission_mode": self.conductor.admission_mode, "dram_bytes": self.prefill.dram_bytes,
                "ssd_bytes": self.prefill.ssd_bytes, "eviction": self.prefill.eviction,
                "decode_pages": self.decode.num_pages, "max_batch": self.decode.max_batch,
                "snapshot_interval_blocks": self.prefill.snapshot_interval_blocks,
                "overheads": self.overheads.source, "seed": self.seed}


@dataclass
class _Life:
    req: ReplayRequest
    seq: int
    keys: tuple[bytes, ...] = ()
    decision: RouteDecision | None = None
    routed_s: float = 0.0
    first_s: float | None = None
    cached_tokens: int = 0
    loaded_tokens: int = 0
    prefill_worker_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class SimResult:
    records: tuple[RequestRecord, ...]  # by index; empty when they went to a streaming sink
    summary: Summary
    stats: dict


class Simulation:
    def __init__(self, scaled: ScaledTrace | TiledTrace, config: SimConfig, costs: CostModels,
                 sink: RecordSink | None = None):
        t = scaled.transform
        self.scaled, self.costs, self.k = scaled, costs, t.blocks_per_trace_block
        self.block_size = t.block_size
        self.config = dataclasses.replace(
            config, prefill=dataclasses.replace(config.prefill, block_size=t.block_size),
            decode=dataclasses.replace(config.decode, block_size=t.block_size))
        c = self.config.conductor
        self.loop = EventLoop()
        self.cluster = SimCluster(self.loop, t.block_size, c.heartbeat_interval_s)
        policy = make_policy(c.policy, PolicyContext(c.routing, costs))
        self.core = ConductorCore(self.cluster, policy, c.slos, self.loop.clock)
        self.keys = KeyCache()
        peers: dict[str, SimPrefill] = {}
        for i in range(self.config.num_prefill):
            w = SimPrefill(f"prefill-{i}", self.config.prefill, costs, self.cluster.index, self.loop, peers,
                           self._prefill_done, self.config.prefill.transfer_backend, self.config.overheads,
                           self._prefill_started, self.config.seed)
            peers[w.worker_id] = w
            self.cluster.add(w)
        for i in range(self.config.num_decode):
            self.cluster.add(SimDecode(f"decode-{i}", self.config.decode, costs, self.loop, self._decode_done,
                                       self._decode_progress, self.config.overheads, self.config.seed))
        self._draw_joins = len(self.config.overheads.decode_join_quantiles_s) > 1  # else none or a constant
        self._rng = random.Random(f"{self.config.seed}/joins")  # drawn in event order: deterministic
        self.lives: dict[str, _Life] = {}  # the requests that have arrived and not ended
        self.sink = sink if sink is not None else KeptRecords()
        self._in_order = InOrder(self.sink) if self.sink.in_index_order else None
        self.num_ended = 0
        self.num_running = 0
        self.admission_queue: deque[_Life] = deque()
        self.prefix_hit_blocks = 0
        self.trace_blocks = 0
        self.load_series: list[tuple[float, int, int, int]] = []  # (t, prefill jobs, decode running, rejected)
        self.num_rejected = 0

    # ---- arrival and admission ----------------------------------------------------------------
    def _arrive(self, life: _Life) -> None:
        self.lives[life.req.request_id] = life
        stall_s = self.config.overheads.decode_stall_s_per_arrival  # the Conductor's work shares the host's cores
        if stall_s > 0:  # (a stall of none is a no-op: not a pass over every decode worker per arrival)
            for decode in self.cluster.decode.values():
                decode.stall(stall_s)
        c = self.config.conductor
        if self.num_running < c.max_running:
            self.num_running += 1
            self._route(life)
        elif len(self.admission_queue) < c.max_queued:
            self.admission_queue.append(life)
            self.loop.at(self.loop.now + c.max_queue_wait_s, self._queue_timeout, life)
        else:
            self._reject(life, f"admission queue full: {self.num_running} running (limit {c.max_running}), "
                               f"{len(self.admission_queue)} queued (limit {c.max_queued})", 1.0)

    def _queue_timeout(self, life: _Life) -> None:
        if life in self.admission_queue:
            self.admission_queue.remove(life)
            self._reject(life, "waited in the admission queue without a free slot", 1.0)

    def _leave(self) -> None:
        self.num_running -= 1
        if self.admission_queue:
            self.num_running += 1
            self._route(self.admission_queue.popleft())

    # ---- routing and prefill ------------------------------------------------------------------
    def _block_keys(self, r: ReplayRequest) -> tuple[bytes, ...]:
        num_full = r.prompt_len // self.block_size
        if r.hash_ids:
            return self.keys.chain(r.hash_ids, num_full, self.k, r.tenant)
        return tuple(chain_keys(r.prompt_ids, self.block_size, FINGERPRINT, r.tenant))

    def _route(self, life: _Life) -> None:
        r = life.req
        life.keys = self._block_keys(r)
        facts = RequestFacts(r.request_id, life.seq, (), r.max_tokens, r.tenant, r.ttft_slo_s or 0.0,
                             r.tbt_slo_s or 0.0, block_keys=life.keys, num_prompt_tokens=r.prompt_len)
        routed = self.core.route(facts)
        match = self.cluster.last_match
        present = max((m.num_blocks_present for m in match.held), default=0) if match else 0
        self.prefix_hit_blocks += present // self.k
        self.trace_blocks += len(r.hash_ids)
        if isinstance(routed.outcome, Rejection):
            self._leave()
            self._reject(life, routed.outcome.reason, routed.outcome.retry_after_s)
            return
        decision = life.decision = routed.outcome
        life.routed_s = self.loop.now
        decode = self.cluster.decode[decision.decode_worker]
        if not decode.try_reserve(r.request_id, r.prompt_len + r.max_tokens):
            self.core.finished(r.request_id)
            self._leave()
            self._reject(life, f"decode cache full on {decode.worker_id}", 1.0)
            return
        prefill = self.cluster.prefill[decision.prefill_worker]
        self.cluster.wake(decode)
        self.cluster.wake(prefill)
        job = SimPrefillJob(r.request_id, r.prompt_len, self.block_size, life.keys, decision.reuse.num_blocks,
                            decision.reuse.holder, cpp_chunk_tokens=decision.cpp_chunk_tokens)
        self._after(self.config.overheads.dispatch_s, prefill.submit, job)

    def _after(self, delay_s: float, fn: Callable[..., None], *args) -> None:
        """``fn(*args)`` in ``delay_s`` (an overhead), or now, in the same event, when it is 0."""
        if delay_s > 0:
            self.loop.at(self.loop.now + delay_s, fn, *args)
        else:
            fn(*args)

    def _prefill_started(self, job: SimPrefillJob) -> None:
        """The worker pushes the reused rows to the decode worker, whose loop pauses to take them."""
        per_token_s = self.config.overheads.decode_stall_s_per_reused_token
        if per_token_s and job.num_reused_tokens:
            decode = self.cluster.decode[self.lives[job.request_id].decision.decode_worker]
            decode.stall(per_token_s * job.num_reused_tokens)

    def _prefill_done(self, job: SimPrefillJob) -> None:
        life = self.lives[job.request_id]
        d = life.decision
        # The first token reaches the client first_token_delay_s after the worker is done.
        life.first_s = self.loop.now + self.config.overheads.first_token_delay_s
        life.cached_tokens, life.loaded_tokens, life.prefill_worker_s = (job.num_reused_tokens, job.num_loaded_tokens,
                                                                         job.worker_s)
        # The modelled worker put its blocks into the index itself, as a live response's events are.
        # What the live Conductor learns of the dispatch around the worker (conductor.speed).
        self.core.prefilled(job.request_id, d.prefill_worker, d.predicted.model_prefill_s, job.worker_s,
                            dispatch_s=self.config.overheads.dispatch_s)
        r = life.req
        decode = self.cluster.decode[d.decode_worker]
        # The response's handling and the verdict stretch the step in progress; an idle loop's
        # next step is this request's, which waits for its join anyway.
        decode.stall(self.config.overheads.decode_stall_s_per_prefill, when_idle=False)
        if r.max_tokens <= 1:
            decode.release(r.request_id)
            self._finish(life)
            return
        self.core.decoding(r.request_id)
        join_s = self.config.overheads.decode_join_s(self._rng.random() if self._draw_joins else 0.0)
        # The join delays are fitted from the client's first token on, which comes that much later.
        self._after(self.config.overheads.first_token_delay_s + join_s, decode.join,
                    SimDecodeRequest(r.request_id, r.prompt_len, r.max_tokens))

    def _decode_progress(self, request: SimDecodeRequest) -> None:
        self.core.generated(request.request_id, request.num_generated)

    def _decode_done(self, request: SimDecodeRequest) -> None:
        life = self.lives[request.request_id]
        life.token_times_s = request.token_times_s
        self._finish(life)

    # ---- records --------------------------------------------------------------------------------
    def _base(self, life: _Life, outcome: str, **fields) -> RequestRecord:
        r = life.req
        return RequestRecord(request_id=r.request_id, index=r.index, source="simulated", outcome=outcome,
                             scheduled_s=r.arrival_s, arrival_s=r.arrival_s, prompt_len=r.prompt_len,
                             max_tokens=r.max_tokens, tenant=r.tenant, ttft_slo_s=r.ttft_slo_s,
                             tbt_slo_s=r.tbt_slo_s, **fields)

    def _record(self, life: _Life, record: RequestRecord) -> None:
        """The request's one record; its state goes with it."""
        del self.lives[life.req.request_id]
        self.num_ended += 1
        if self._in_order is not None:
            self._in_order.add(life.seq, record)
        else:
            self.sink.add(record)

    def _reject(self, life: _Life, reason: str, retry_after_s: float) -> None:
        self.num_rejected += 1
        self._record(life, self._base(life, REJECTED, status="RESOURCE_EXHAUSTED", error=reason,
                                      retry_after_s=retry_after_s, latency_s=self.loop.now - life.req.arrival_s))

    def _finish(self, life: _Life) -> None:
        r, d, now = life.req, life.decision, self.loop.now
        self.core.finished(r.request_id)
        self._leave()
        ttft = life.first_s - r.arrival_s
        arrival_s = r.arrival_s
        times = (ttft, *[t - arrival_s for t in life.token_times_s])
        self._record(life, self._base(
            life, FINISHED, finish_reason="length", ttft_s=ttft, latency_s=max(now - r.arrival_s, times[-1]),
            queue_s=life.routed_s + self.config.overheads.dispatch_s - r.arrival_s, token_times_s=times,
            prompt_tokens=r.prompt_len,
            cached_tokens=life.cached_tokens, loaded_cached_tokens=life.loaded_tokens,
            prefill_worker_s=life.prefill_worker_s, prefill_worker=d.prefill_worker, decode_worker=d.decode_worker,
            route_branch=d.branch.value, pulled_from=d.reuse.holder or "",
            predicted_ttft_s=d.predicted.ttft_s or None, predicted_tbt_s=d.predicted.tbt_s or None))

    # ---- the run --------------------------------------------------------------------------------
    def _sample_load(self, num_requests: int) -> None:
        """One point of the load series: prefill jobs held, decode requests running, rejections so far."""
        prefill = sum(len(w.queue) + (w.running is not None) for w in self.cluster.prefill.values())
        decode = sum(len(w.running) for w in self.cluster.decode.values())
        self.load_series.append((self.loop.now, prefill, decode, self.num_rejected))
        if self.num_ended < num_requests:
            self.loop.at(self.loop.now + self.config.load_sample_interval_s, self._sample_load, num_requests)

    def _arrivals(self) -> Iterator[tuple[float, Callable[..., None], tuple]]:
        """Every request's arrival, in the order the event queue would run them had they all
        been queued first: by time (none before 0), then by position; ``seq`` is the position."""
        requests = self.scaled.requests
        if isinstance(requests, Sequence):
            order = sorted(range(len(requests)), key=lambda i: (max(requests[i].arrival_s, 0.0), i))
            pairs = ((i, requests[i]) for i in order)
        else:
            pairs = enumerate(requests)  # a stream: in arrival order already (EventLoop.feed checks)
        for seq, r in pairs:
            yield max(r.arrival_s, 0.0), self._arrive, (_Life(r, seq),)

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        num_requests = self.scaled.num_requests
        self.loop.feed(self._arrivals())
        self.cluster.start_heartbeats()
        self.loop.at(0.0, self._sample_load, num_requests)
        self.loop.run()
        assert self.num_ended == num_requests and not self.lives, f"{self.num_ended} ended of {num_requests} requests"
        stats = {
            "wall_s": time.perf_counter() - wall0, "num_events": self.loop.num_events,
            "prefix_hit_ratio_blocks": self.prefix_hit_blocks / self.trace_blocks if self.trace_blocks else 0.0,
            "prefill_busy_s": {w.worker_id: w.num_busy_s for w in self.cluster.prefill.values()},
            "config": self.config.describe(),
            "load": self.load_series,
        }
        summary = self.sink.finish(trace=self.scaled.describe(), run={"simulator": stats})
        records = tuple(self.sink.records) if isinstance(self.sink, KeptRecords) else ()
        return SimResult(records, summary, stats)


def simulate(scaled: ScaledTrace | TiledTrace, config: SimConfig, costs: CostModels,
             sink: RecordSink | None = None) -> SimResult:
    """Runs the whole scaled trace through a simulated cluster; see the module docstring."""
    return Simulation(scaled, config, costs, sink).run()
