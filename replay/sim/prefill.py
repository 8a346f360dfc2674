"""A modelled prefill worker: one prefill at a time in arrival order, as the live runner does,
over a real ``Placement`` of sized blocks (device, DRAM and SSD capacities in bytes, the
configured eviction policy, demotion and promotion) whose every change is published to the index.

A job's reuse follows the live runner (``prefill_worker.runner``): at its start it takes the
planned leading blocks from the holder (a pull, kept here: a replica) or from its own store,
stops at the first missing one, and cuts back to the deepest block with a KDA snapshot. It
then takes ``pull_s`` (when it pulled), ``prefill_s(new, reused)`` of the live worker
(``ClusterOverheads.live_prefill``: the calibration's by default) and
``reuse_load_s_per_token`` for each reused token it copied into pages rather than reused in
place (pulled, or found below the top tier: the live worker reuses only the leading run of
device-tier blocks in place), those two times a ratio drawn from the worker's seeded
generator (``ClusterOverheads.prefill_ratio_quantiles``; none by default), and stores every
new full block, with snapshots at the snapshot points. That whole time is the job's
``worker_s``, what a live worker reports in its Prefill response. ``on_start(job)`` is called
once the job's reuse is known, when a live worker pushes the reused rows to the decode worker.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from clusterstate.state import ClusterState
from clusterstate.workers import PrefillJobLoad, WorkerLoad
from conductor.cpp import one_chunk_from, pipelined_from
from costmodel import CostModels
from costmodel.overheads import NO_OVERHEADS, ClusterOverheads
from kvstore.blocks import BlockKey, Tier
from kvstore.hitrule import SnapshotPolicy, usable_length
from kvstore.placement import Placement, StoreEvent
from kvstore.sized import SizedBlob, SizedTier
from prefill_worker.config import PrefillConfig
from replay.sim.events import EventLoop


@dataclass
class SimPrefillJob:
    request_id: str
    num_prompt_tokens: int
    block_size: int
    keys: tuple[BlockKey, ...]  # the prompt's full blocks
    num_reuse_blocks: int  # planned
    holder: str | None
    started_s: float | None = None
    num_reused_tokens: int = 0  # actual, once started
    num_loaded_tokens: int = 0  # of those, copied into pages (pulled, or from DRAM or SSD): not in place
    pulled: bool = False
    worker_s: float = 0.0  # the worker's time for it (pull + prefill), once started
    cpp_chunk_tokens: int = 0  # a CPP group pipelines it in chunks of this (the decision's; conductor.cpp)

    @property
    def planned_reused_tokens(self) -> int:
        return min(self.num_reuse_blocks * self.block_size, self.num_prompt_tokens - 1)


class SimPrefill:
    def __init__(self, worker_id: str, config: PrefillConfig, costs: CostModels, index: ClusterState,
                 loop: EventLoop, peers: dict[str, SimPrefill], on_done: Callable[[SimPrefillJob], None],
                 backend: str = "tcp", overheads: ClusterOverheads = NO_OVERHEADS,
                 on_start: Callable[[SimPrefillJob], None] = lambda job: None, seed: int = 0):
        self.worker_id, self.config, self.costs, self.index, self.loop = worker_id, config, costs, index, loop
        self.peers, self.on_done, self.on_start, self.backend = peers, on_done, on_start, backend
        self.overheads = overheads
        self.live_costs = overheads.live_prefill(costs)  # the worker's own time; costs stays for pulls and sizes
        self._draw_ratios = len(overheads.prefill_ratio_quantiles) > 1  # else none or a constant
        self._rng = random.Random(f"{seed}/prefill/{worker_id}")  # drawn in start order: deterministic
        self.block_size = config.block_size
        # The calibrated model's state size is its cache layout's: none (all attention) means every
        # block carries its empty snapshot, as on a live worker.
        self.snapshots = SnapshotPolicy(config.snapshot_interval_blocks, has_state=costs.snapshot_bytes > 0)
        tiers = {Tier.DRAM: SizedTier(Tier.DRAM, config.dram_bytes), Tier.SSD: SizedTier(Tier.SSD, config.ssd_bytes)}
        if config.device_bytes:
            tiers[Tier.DEVICE] = SizedTier(Tier.DEVICE, config.device_bytes)
        # New blocks land in the fastest tier, and a reused block moves up there, as the live
        # worker keeps the pages a prefill computed or loaded them into (its device tier).
        self.top = min(tiers)
        self._events: list[StoreEvent] = []  # the store's changes since the last flush
        self.store = Placement(tiers, config.eviction, self.top, on_event=self._events.append)
        self.queue: deque[SimPrefillJob] = deque()
        self._queued_loads: deque[PrefillJobLoad] = deque()  # each queued job as a heartbeat lists it
        self.running: SimPrefillJob | None = None
        self.num_busy_s = 0.0
        block_bytes = self.block_size * costs.kv_bytes_per_token
        self._blobs = (SizedBlob(block_bytes, False), SizedBlob(block_bytes + costs.snapshot_bytes, True))

    def _flush_events(self) -> None:
        """Publishes the store's changes in one batch, as a Prefill response carries them
        (each a ``BlockEvent.stored``/``removed`` on a live worker; applied as such here)."""
        if self._events:
            self.index.apply_store_events(self.worker_id, self._events)
            self._events.clear()

    def _blob(self, has_snapshot: bool) -> SizedBlob:
        """A new block's size (one value per kind: blobs are frozen, so every block shares it)."""
        return self._blobs[has_snapshot]

    # ---- the queue ----------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return self.running is None and not self.queue

    def submit(self, job: SimPrefillJob) -> None:
        self.queue.append(job)
        reused = job.planned_reused_tokens
        self._queued_loads.append(PrefillJobLoad(job.request_id, job.num_prompt_tokens - reused, reused))
        if self.running is None:
            self._start_next()

    def load(self) -> WorkerLoad:
        jobs = []
        if self.running is not None:
            j = self.running
            jobs.append(PrefillJobLoad(j.request_id, j.num_prompt_tokens - j.num_reused_tokens, j.num_reused_tokens,
                                       max(1e-9, self.loop.now - (j.started_s or self.loop.now))))
        jobs += self._queued_loads  # (made once per job, on submit)
        return WorkerLoad(num_queued=len(self.queue), num_running=int(self.running is not None),
                          num_free_pages=self.config.num_pages, prefill_jobs=tuple(jobs),
                          timestamp_s=self.loop.clock.wall())

    def _start_next(self) -> None:
        if not self.queue:
            self.running = None
            return
        job = self.running = self.queue.popleft()
        self._queued_loads.popleft()
        job.started_s = self.loop.now
        pull_s = self._reuse(job)
        n, reused = job.num_prompt_tokens, job.num_reused_tokens
        single_s = self.overheads.worker_prefill_s(self.live_costs, n - reused, reused, job.num_loaded_tokens)
        single_s *= self.overheads.prefill_ratio(self._rng.random() if self._draw_ratios else 0.0)
        job.worker_s = pull_s + self._stages_s(single_s, n - reused, job.cpp_chunk_tokens)
        self.num_busy_s += job.worker_s
        self.on_start(job)
        self.loop.at(self.loop.now + job.worker_s, self._finish, job)

    def _stages_s(self, single_s: float, new_tokens: int, chunk_tokens: int) -> float:
        """A CPP group's time for a prefill the single instance takes ``single_s`` for: pipelined
        in the decision's chunks, or the stages in turn (``conductor.cpp``, the Conductor's own
        prediction); a plain worker's is ``single_s``."""
        stages = self.config.cpp_stages
        if stages <= 1:
            return single_s
        if chunk_tokens:
            return pipelined_from(single_s, self.live_costs.prefill_const_s, new_tokens, stages, chunk_tokens)
        return one_chunk_from(single_s, stages)

    # ---- reuse, compute, store ----------------------------------------------------------------
    def _reuse(self, job: SimPrefillJob) -> float:
        """Loads the planned prefix (as the live runner does); returns the pull's time."""
        keys = job.keys[: job.num_reuse_blocks]
        found: list[SizedBlob] = []
        pull_s = 0.0
        if job.holder is not None and keys:
            holder = self.peers[job.holder]
            pulled = [holder.store.get(k) for k in keys]
            if all(b is not None for b in pulled):  # PushBlocks sends all or fails
                tier = max((holder.store.where.get(k, Tier.DRAM) for k in keys), default=Tier.DRAM)
                num_snapshots = sum(b.has_snapshot for b in pulled)
                pull_s = self.costs.pull_s(len(keys) * self.block_size, num_snapshots, self.backend, tier)
                for key, blob in zip(keys, pulled, strict=True):
                    self.store.put(key, blob, blob.has_snapshot, self.top)
                found = pulled
                job.pulled = True
        in_place = 0  # the leading run of them in the top tier: the live worker reuses it in place
        if not found:
            for key in keys:
                on_top = self.store.where.get(key) == self.top
                blob = self.store.get(key)
                if blob is None:
                    break
                found.append(blob)
                if on_top and in_place == len(found) - 1:
                    in_place += 1
        del found[usable_length([b.has_snapshot for b in found]):]
        job.num_reused_tokens = len(found) * self.block_size
        job.num_loaded_tokens = job.num_reused_tokens - min(in_place, len(found)) * self.block_size
        self._flush_events()
        return pull_s

    def _finish(self, job: SimPrefillJob) -> None:
        keys, put, top, blobs = job.keys, self.store.put, self.top, self._blobs
        points = set(self.snapshots.snapshot_points(len(keys)))
        for i in range(job.num_reused_tokens // self.block_size, len(keys)):
            snap = i in points
            put(keys[i], blobs[snap], snap, top)
        self._flush_events()
        self.on_done(job)
        self._start_next()
