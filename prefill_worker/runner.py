"""One prefill, start to end: reserve, reuse the prefix, prefill while streaming KV, store.

Owns the order of a prefill over the worker's engine state (the model, and the cache manager
whose page pool the store's device tier shares):

1. reuse: pull the planned leading blocks from the holder worker through the transfer engine
   (and keep them: hot prefixes replicate), or take them from the own store: the leading run
   held in the device tier pinned and shared in place, the rest copied from DRAM or SSD; stop
   at the deepest block that carries a KDA snapshot (the hybrid hit rule);
2. reserve pages + a KDA slot for the prompt, sharing the in-place pages (``Busy`` when they
   do not fit now, even after demoting unpinned device blocks to DRAM);
3. push the reused rows, then run chunked prefill over the rest with a per-layer hook that
   pushes each layer's new rows while the next layer computes; push every KDA layer's final
   state; sample the first token; wait for the decode worker's verdict;
4. keep every full block not reused in place in the device tier, in the page it was computed
   or loaded in (a copy to DRAM when the tier cannot take it), and return the events.
The cache is always released and the pins dropped, whatever happens.

Prefills run one at a time (``_engine_lock``); waiting requests count as the queue. One whose
caller left while it waited (``is_cancelled``) does no work: it ABORTs its placement, so the
decode worker frees the reservation at once, which matters when the caller was a Conductor that
died and will never release it.
Metrics (``prefill_worker.metrics.PrefillMetrics``, optional): tokens and duration per
prefill and per stage (``StageClock``), layer and chunk compute times from the per-layer
hook; gauges read ``load()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from clusterstate.workers import PrefillJobLoad, WorkerLoad
from engine import CacheManager, HybridModel, SequenceCache, sample
from kvstore.device import Snapshot
from kvstore.hitrule import SnapshotPolicy, usable_length
from kvstore.payload import BlockPayload
from kvstore.payload_format import PayloadError, decode
from kvstore.store import TieredStore
from kvstore.transfer.base import TransferError
from kvstore.transfer.frames import Kind
from prefill_worker.blocks import payload_of_block, resume_from_blocks
from prefill_worker.metrics import STAGES, PrefillMetrics
from prefill_worker.transfers import TransferHub
from runtime.calls import PrefillCall, PrefillResult
from runtime.errors import Conflict, InvalidRequest, NoRoom

log = logging.getLogger(__name__)


class Busy(NoRoom):
    """The worker cannot hold the request's cache now; the Conductor may retry elsewhere."""


class Cancelled(Exception):
    """The caller went away."""


class StageClock:
    """Seconds one prefill spends in each stage (``prefill_worker.metrics.STAGES``): ``queue``
    (waiting for the engine), ``reuse`` (planning, reserving and loading the reused prefix),
    ``compute`` (the model, between layer hooks), ``push`` (handing KV frames to the sender,
    in the hooks and after), ``verdict`` (waiting for the decode worker's receive verdict),
    ``store`` (keeping the new blocks). ``lap(stage)`` charges the time since the last lap."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self._mark = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] += now - self._mark
        self._mark = now

    @property
    def last_lap_s(self) -> float:
        """``time.perf_counter()`` at the last lap (or at the start)."""
        return self._mark


@dataclass
class Reuse:
    """The blocks a prefill starts from: ``in_place`` (page, snapshot) of the leading run held
    in the device tier, whose keys are ``pinned`` until the prefill ends, then ``loaded``
    payloads copied into fresh pages after them."""

    in_place: list[tuple[int, Snapshot | None]] = field(default_factory=list)
    pinned: list[bytes] = field(default_factory=list)
    loaded: list[BlockPayload] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.in_place) + len(self.loaded)

    @property
    def in_place_snapshot(self) -> Snapshot | None:
        return self.in_place[-1][1] if self.in_place else None


class PrefillRunner:
    def __init__(self, model: HybridModel, store: TieredStore, hub: TransferHub, cache: CacheManager,
                 snapshot_interval_blocks: int, metrics: PrefillMetrics | None = None):
        """``cache``: the engine's pages; the store's device tier, if it has one, is over its pool."""
        self.model = model
        self.store = store
        self.hub = hub
        self.cache = cache
        # A model without state layers (its cache layout says so) keeps an empty snapshot at every block.
        self.snapshots = SnapshotPolicy(snapshot_interval_blocks, has_state=model.cfg.cache_layout.has_state)
        self._engine_lock = threading.Lock()
        self.draining = False
        self._waiting = 0
        self._count_lock = threading.Lock()
        # request id -> (new tokens, reused tokens, perf_counter start or None while queued)
        self._jobs: dict[str, tuple[int, int, float | None]] = {}
        self.metrics = metrics or PrefillMetrics.disabled()
        self.metrics.watch(self)

    @property
    def queue_len(self) -> int:
        return self._waiting

    def load(self) -> WorkerLoad:
        """Queued and running prefills (heartbeat payload). Thread-safe."""
        now = time.perf_counter()
        with self._count_lock:
            jobs = tuple(PrefillJobLoad(rid, new, reused, 0.0 if start is None else now - start)
                         for rid, (new, reused, start) in self._jobs.items())
        running = sum(j.elapsed_s > 0 for j in jobs)
        return WorkerLoad(num_queued=len(jobs) - running, num_running=running,
                          num_free_pages=self.free_pages(), prefill_jobs=jobs, timestamp_s=time.time())

    def free_pages(self) -> int:
        """Pages a new request can get: free ones plus those of unpinned device-tier blocks
        (demoted on demand)."""
        return self.cache.pool.num_free + self.store.num_evictable_device_blocks()

    def run(self, job: PrefillCall, is_cancelled: Callable[[], bool]) -> PrefillResult:
        bs = self.cache.block_size
        if len(job.block_keys) != len(job.token_ids) // bs:
            raise InvalidRequest(f"{len(job.block_keys)} block keys for {len(job.token_ids)} tokens "
                             f"(block_size {bs} makes {len(job.token_ids) // bs} full blocks)")
        reused = min(job.num_reuse_blocks * bs, len(job.token_ids) - 1)
        with self._count_lock:
            if self.draining:
                raise Busy("prefill worker is draining for shutdown")
            if job.placement_id in self._jobs:
                raise Conflict(f"request {job.placement_id} is already prefilling here")
            self._waiting += 1
            self._jobs[job.placement_id] = (len(job.token_ids) - reused, reused, None)
        clock = StageClock()
        try:
            with self._engine_lock:
                clock.lap("queue")
                with self._count_lock:
                    self._waiting -= 1
                    self._jobs[job.placement_id] = (len(job.token_ids) - reused, reused, time.perf_counter())
                return self._run_locked(job, is_cancelled, clock)
        finally:
            with self._count_lock:
                self._jobs.pop(job.placement_id, None)

    def drain(self, timeout_s: float) -> None:
        """Refuses new prefills and waits (up to timeout_s) for the queued and running ones."""
        until = time.monotonic() + timeout_s
        with self._count_lock:
            self.draining = True
        while time.monotonic() < until and self._engine_lock.acquire(timeout=max(0.0, until - time.monotonic())):
            self._engine_lock.release()
            with self._count_lock:
                if self._waiting == 0:
                    return
            time.sleep(0.01)  # let a queued prefill take the lock

    def check_integrity(self) -> None:
        """The store's invariants, and every page's holders exactly the live requests plus the
        device tier. AssertionError otherwise."""
        with self._engine_lock:
            self.store.check_integrity()
            self.cache.check_integrity(self.store.device_pages())

    @torch.inference_mode()
    def _run_locked(self, job: PrefillCall, is_cancelled: Callable[[], bool], clock: StageClock) -> PrefillResult:
        t0 = clock.last_lap_s  # the engine lock was taken: the prefill's stages start here
        reuse, seq, sender = Reuse(), None, None
        try:
            if is_cancelled():
                # Its caller left while it queued (a client's cancel, or its Conductor died):
                # no work, and the ABORT below, so that the decode worker frees the
                # reservation now rather than at its TTL (a dead Conductor releases nothing).
                sender = self.hub.sender(job.decode_transfer_address)
                raise Cancelled(f"request {job.placement_id} cancelled while queued")
            self._plan_reuse(job, reuse)
            seq = self._reserve(job, reuse)
            cached = resume_from_blocks(self.model, self.cache, seq, len(reuse.in_place), reuse.in_place_snapshot,
                                        reuse.loaded)
            sender = self.hub.sender(job.decode_transfer_address)
            clock.lap("reuse")
            first = self._prefill_and_push(job, seq, cached, sender, is_cancelled, clock)
            if is_cancelled():  # after the last layer: once the KV is complete, only a Decode call frees it
                raise Cancelled(f"request {job.placement_id} cancelled before its verdict")
            sender.finish(job.placement_id, self.model.cfg.num_hidden_layers, timeout_s=job.deadline_s)
            clock.lap("verdict")
            self._store_new_blocks(job, seq, len(reuse.in_place))
            clock.lap("store")
            prefill_s = time.perf_counter() - t0
            self.metrics.prefilled(len(job.token_ids) - cached, cached, prefill_s)
            self.metrics.stages(clock.seconds)
            loaded = max(0, cached - len(reuse.in_place) * self.cache.block_size)
            s = clock.seconds
            return PrefillResult(first, cached, prefill_s, loaded, queue_s=s["queue"],
                                 handoff_s=s["push"] + s["verdict"])
        except BaseException as e:
            if sender is not None:
                # Wait until the decode worker has handled the ABORT (and every frame before it):
                # the Conductor may retry this request id on the same connection right away.
                sender.abort(job.placement_id, f"prefill failed: {e}", wait_s=self.hub.config.connect_timeout_s)
            raise
        finally:
            if seq is not None:
                self.cache.release(seq)
            self.store.unpin(reuse.pinned)

    def _reserve(self, job: PrefillCall, reuse: Reuse) -> SequenceCache:
        """The request's cache: the reused device pages shared, fresh pages for the rest; when
        the pool is short, unpinned device blocks are demoted to DRAM to free pages."""
        n = len(job.token_ids)
        shared = [page for page, _ in reuse.in_place]
        seq = self.cache.try_reserve(job.placement_id, n, shared_pages=shared)
        if seq is None and self.store.free_device_pages(self.cache.pages_for(n) - len(shared)):
            seq = self.cache.try_reserve(job.placement_id, n, shared_pages=shared)
        if seq is None:
            raise Busy(f"prefill cache full: {n} tokens need {self.cache.pages_for(n) - len(shared)} "
                       f"new pages, {self.cache.pool.num_free} free")
        return seq

    # ---- reuse --------------------------------------------------------------------------------
    def _plan_reuse(self, job: PrefillCall, reuse: Reuse) -> None:
        """Fills ``reuse`` with the leading blocks to reuse, cut back to the deepest one with a
        KDA snapshot: first the run held in the device tier (pinned, reused in place), then
        blocks copied in from the holder worker or the own DRAM/SSD tiers."""
        keys = list(job.block_keys[: job.num_reuse_blocks])
        if not keys:
            return
        if job.holder_rpc_address:
            reuse.loaded = self._pull(job, keys)
        if not reuse.loaded:
            reuse.in_place = self.store.pin_device_prefix(keys)
            reuse.pinned = keys[: len(reuse.in_place)]
            for key in keys[len(reuse.in_place):]:
                p = self.store.try_get(key)
                if p is None:
                    break
                reuse.loaded.append(p)
        usable = usable_length([s is not None for _, s in reuse.in_place] + [p.has_snapshot for p in reuse.loaded])
        del reuse.loaded[max(0, usable - len(reuse.in_place)):]
        del reuse.in_place[usable:]
        if reuse.num_blocks < len(keys):
            log.info("request %s: reusing %d of %d planned blocks (%d in place)", job.placement_id,
                     reuse.num_blocks, len(keys), len(reuse.in_place))

    def _pull(self, job: PrefillCall, keys: list[bytes]) -> list[BlockPayload]:
        """Blocks from the holder worker; they are kept here too. [] when the pull fails."""
        try:
            blobs = self.hub.pull_blocks(f"{job.placement_id}/pull", job.holder_rpc_address, keys, job.deadline_s,
                                         job.placement_id, job.grant, job.grant_expiry_ms, job.holder_worker)
            payloads = [decode(b, expected_fingerprint=self.model.fingerprint) for b in blobs]
        except (TransferError, PayloadError) as e:
            log.warning("request %s: pulling %d blocks from %s failed (%s); recomputing",
                        job.placement_id, len(keys), job.holder_rpc_address, e)
            return []
        for key, payload in zip(keys, payloads, strict=True):
            self.store.put(key, payload)
        return payloads

    # ---- compute and push ---------------------------------------------------------------------
    def _prefill_and_push(self, job: PrefillCall, seq: SequenceCache, cached: int, sender,
                          is_cancelled: Callable[[], bool], clock: StageClock) -> int:
        cfg, rid = self.model.cfg, job.placement_id
        mla_index = {layer: i for i, layer in enumerate(cfg.mla_layer_ids)}
        if cached:
            for layer, i in mla_index.items():
                self._push_rows(sender, rid, seq, layer, i, 0, cached)
            clock.lap("push")

        timer = self.metrics.layer_timer(cfg.num_hidden_layers - 1, mla_index)

        def on_layer(layer: int, start: int, end: int) -> None:
            timer.layer_done(layer)
            clock.lap("compute")
            if is_cancelled():
                raise Cancelled(f"request {rid} cancelled during prefill")
            if layer in mla_index:
                self._push_rows(sender, rid, seq, layer, mla_index[layer], start, end)
            clock.lap("push")
            timer.resume(layer)

        bs = self.cache.block_size
        points = [(i + 1) * bs for i in self.snapshots.snapshot_points(len(job.token_ids) // bs)]
        # A pipelined (CPP) instance cuts the prompt as the Conductor chose; others ignore it.
        pipeline = {"pipeline_chunk_tokens": job.cpp_chunk_tokens} if getattr(self.model, "pipelined", False) else {}
        logits = self.model.prefill(self.cache, seq, job.token_ids[cached:],
                                    snapshot_at=[p for p in points if p > cached], on_layer=on_layer, **pipeline)
        n = len(job.token_ids)
        first = sample(logits, [job.sampling], [n])[0]
        clock.lap("compute")
        for i, layer in enumerate(cfg.kda_layer_ids):
            sender.send(rid, layer, Kind.KDA_STATE, (0, n), self.cache.slots.state[i, seq.slot].clone())
            sender.send(rid, layer, Kind.KDA_CONV, (0, n), self.cache.slots.conv[i, seq.slot].clone())
        clock.lap("push")
        return first

    def _push_rows(self, sender, rid: str, seq: SequenceCache, layer: int, mla_index: int,
                   start: int, end: int) -> None:
        """Sends rows [start, end) of one MLA layer in frames of at most max_frame_bytes."""
        kv = self.cache.pool.kv
        row_bytes = kv.shape[-1] * kv.element_size()
        step = max(1, self.hub.config.max_frame_bytes // row_bytes)
        for lo in range(start, end, step):
            hi = min(end, lo + step)
            sender.send(rid, layer, Kind.MLA_ROWS, (lo, hi), self.cache.rows(seq, mla_index, lo, hi))

    def _store_new_blocks(self, job: PrefillCall, seq: SequenceCache, in_place: int) -> None:
        """Every full block not reused in place: kept in the device tier as the page it was
        computed (or loaded) in; when the device tier cannot take it, copied to DRAM."""
        bs = self.cache.block_size
        for i in range(in_place, len(job.block_keys)):
            key, snapshot = job.block_keys[i], seq.snapshots.get((i + 1) * bs)
            if self.store.adopt(key, seq.pages[i], snapshot):
                continue
            if not self.store.contains(key) or (snapshot is not None and not self.store.has_snapshot(key)):
                self.store.put(key, payload_of_block(self.model, self.cache, seq, i))
