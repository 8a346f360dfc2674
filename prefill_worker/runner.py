"""One prefill, start to end: reserve, reuse the prefix, prefill while streaming KV, store.

Owns the worker's engine state (model, cache manager) and the order of a prefill:

1. reserve pages + a KDA slot for the prompt (``Busy`` when they do not fit now);
2. reuse: take the planned leading blocks from the own store, or pull them from the holder
   worker through the transfer engine (and keep them: hot prefixes replicate); stop at the
   deepest block that carries a KDA snapshot (the hybrid hit rule);
3. push the reused rows, then run chunked prefill over the rest with a per-layer hook that
   pushes each layer's new rows while the next layer computes; push every KDA layer's final
   state; sample the first token; wait for the decode worker's verdict;
4. store every new full block (with snapshots at the snapshot points) and return the events.
The cache is always released, whatever happens.

Prefills run one at a time (``_engine_lock``); waiting requests count as the queue.
Metrics (``prefill_worker.metrics.PrefillMetrics``, optional): tokens and duration per
prefill, layer and chunk compute times from the per-layer hook; gauges read ``load()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import HybridModel, SamplingParams, SequenceCache, sample
from kvstore.hitrule import SnapshotPolicy
from kvstore.index import PrefillJobLoad, WorkerLoad
from kvstore.payload import BlockPayload, PayloadError, decode
from kvstore.store import TieredStore
from kvstore.transfer.base import TransferError
from kvstore.transfer.frames import Kind
from prefill_worker.blocks import load_blocks, payload_of_block
from prefill_worker.metrics import PrefillMetrics
from prefill_worker.transfers import TransferHub

log = logging.getLogger(__name__)


class Busy(Exception):
    """The worker cannot hold the request's cache now; the Conductor may retry elsewhere."""


class Cancelled(Exception):
    """The caller went away."""


@dataclass(frozen=True)
class PrefillJob:
    request_id: str
    token_ids: tuple[int, ...]
    params: SamplingParams
    block_keys: tuple[bytes, ...]
    reuse_blocks: int
    holder_rpc_address: str  # "" = own store
    decode_address: str
    deadline_s: float
    grant: bytes = b""  # the Conductor's grant for pulling from the holder (runtime.auth.grant)
    grant_expiry_ms: int = 0


@dataclass(frozen=True)
class PrefillOutcome:
    first_token: int
    cached_tokens: int
    prefill_s: float


class PrefillRunner:
    def __init__(self, model: HybridModel, store: TieredStore, hub: TransferHub, num_pages: int,
                 block_size: int, snapshot_interval_blocks: int, metrics: PrefillMetrics | None = None):
        self.model = model
        self.store = store
        self.hub = hub
        self.cache = model.new_cache(num_pages, num_slots=2, block_size=block_size)
        self.snapshots = SnapshotPolicy(snapshot_interval_blocks)
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
                          num_free_pages=self.cache.pool.num_free, prefill_jobs=jobs, timestamp_s=time.time())

    def run(self, job: PrefillJob, is_cancelled: Callable[[], bool]) -> PrefillOutcome:
        bs = self.cache.block_size
        if len(job.block_keys) != len(job.token_ids) // bs:
            raise ValueError(f"{len(job.block_keys)} block keys for {len(job.token_ids)} tokens "
                             f"(block_size {bs} makes {len(job.token_ids) // bs} full blocks)")
        reused = min(job.reuse_blocks * bs, len(job.token_ids) - 1)
        with self._count_lock:
            if self.draining:
                raise Busy("prefill worker is draining for shutdown")
            if job.request_id in self._jobs:
                raise ValueError(f"request {job.request_id} is already prefilling here")
            self._waiting += 1
            self._jobs[job.request_id] = (len(job.token_ids) - reused, reused, None)
        try:
            with self._engine_lock:
                with self._count_lock:
                    self._waiting -= 1
                    self._jobs[job.request_id] = (len(job.token_ids) - reused, reused, time.perf_counter())
                return self._run_locked(job, is_cancelled)
        finally:
            with self._count_lock:
                self._jobs.pop(job.request_id, None)

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

    @torch.inference_mode()
    def _run_locked(self, job: PrefillJob, is_cancelled: Callable[[], bool]) -> PrefillOutcome:
        t0 = time.perf_counter()
        seq = self.cache.try_reserve(job.request_id, len(job.token_ids))
        if seq is None:
            raise Busy(f"prefill cache full: {len(job.token_ids)} tokens need "
                       f"{self.cache.pages_for(len(job.token_ids))} pages, {self.cache.pool.num_free} free")
        sender = None
        try:
            cached = load_blocks(self.model, self.cache, seq, self._reuse_payloads(job))
            sender = self.hub.sender(job.decode_address)
            first = self._prefill_and_push(job, seq, cached, sender, is_cancelled)
            sender.finish(job.request_id, self.model.cfg.num_hidden_layers, timeout_s=job.deadline_s)
            self._store_new_blocks(job, seq, cached)
            prefill_s = time.perf_counter() - t0
            self.metrics.prefilled(len(job.token_ids) - cached, cached, prefill_s)
            return PrefillOutcome(first, cached, prefill_s)
        except BaseException as e:
            if sender is not None:
                # Wait until the decode worker has handled the ABORT (and every frame before it):
                # the Conductor may retry this request id on the same connection right away.
                sender.abort(job.request_id, f"prefill failed: {e}", wait_s=self.hub.config.connect_timeout_s)
            raise
        finally:
            self.cache.release(seq)

    # ---- reuse --------------------------------------------------------------------------------
    def _reuse_payloads(self, job: PrefillJob) -> list[BlockPayload]:
        """The leading blocks to reuse, cut back to the deepest one with a KDA snapshot."""
        keys = list(job.block_keys[: job.reuse_blocks])
        if not keys:
            return []
        payloads: list[BlockPayload] = []
        if job.holder_rpc_address:
            payloads = self._pull(job, keys)
        if not payloads:
            for key in keys:
                p = self.store.try_get(key)
                if p is None:
                    break
                payloads.append(p)
        while payloads and not payloads[-1].has_snapshot:
            payloads.pop()
        if len(payloads) < len(keys):
            log.info("request %s: reusing %d of %d planned blocks", job.request_id, len(payloads), len(keys))
        return payloads

    def _pull(self, job: PrefillJob, keys: list[bytes]) -> list[BlockPayload]:
        """Blocks from the holder worker; they are kept here too. [] when the pull fails."""
        try:
            blobs = self.hub.pull_blocks(f"{job.request_id}/pull", job.holder_rpc_address, keys, job.deadline_s,
                                         job.request_id, job.grant, job.grant_expiry_ms)
            payloads = [decode(b, expected_fingerprint=self.model.fingerprint) for b in blobs]
        except (TransferError, PayloadError) as e:
            log.warning("request %s: pulling %d blocks from %s failed (%s); recomputing",
                        job.request_id, len(keys), job.holder_rpc_address, e)
            return []
        for key, payload in zip(keys, payloads, strict=True):
            self.store.put(key, payload)
        return payloads

    # ---- compute and push ---------------------------------------------------------------------
    def _prefill_and_push(self, job: PrefillJob, seq: SequenceCache, cached: int, sender,
                          is_cancelled: Callable[[], bool]) -> int:
        cfg, rid = self.model.cfg, job.request_id
        mla_index = {layer: i for i, layer in enumerate(cfg.mla_layer_ids)}
        if cached:
            for layer, i in mla_index.items():
                self._push_rows(sender, rid, seq, layer, i, 0, cached)

        timer = self.metrics.layer_timer(cfg.num_hidden_layers - 1, mla_index)

        def on_layer(layer: int, start: int, end: int) -> None:
            timer.layer_done(layer)
            if is_cancelled():
                raise Cancelled(f"request {rid} cancelled during prefill")
            if layer in mla_index:
                self._push_rows(sender, rid, seq, layer, mla_index[layer], start, end)
            timer.resume(layer)

        bs = self.cache.block_size
        points = [(i + 1) * bs for i in self.snapshots.snapshot_points(len(job.token_ids) // bs)]
        logits = self.model.prefill(self.cache, seq, job.token_ids[cached:],
                                    snapshot_at=[p for p in points if p > cached], on_layer=on_layer)
        n = len(job.token_ids)
        for i, layer in enumerate(cfg.kda_layer_ids):
            sender.send(rid, layer, Kind.KDA_STATE, (0, n), self.cache.slots.state[i, seq.slot].clone())
            sender.send(rid, layer, Kind.KDA_CONV, (0, n), self.cache.slots.conv[i, seq.slot].clone())
        return sample(logits, [job.params], [n])[0]

    def _push_rows(self, sender, rid: str, seq: SequenceCache, layer: int, mla_index: int,
                   start: int, end: int) -> None:
        """Sends rows [start, end) of one MLA layer in frames of at most max_frame_bytes."""
        kv = self.cache.pool.kv
        row_bytes = kv.shape[-1] * kv.element_size()
        step = max(1, self.hub.config.max_frame_bytes // row_bytes)
        for lo in range(start, end, step):
            hi = min(end, lo + step)
            sender.send(rid, layer, Kind.MLA_ROWS, (lo, hi), self.cache.rows(seq, mla_index, lo, hi))

    def _store_new_blocks(self, job: PrefillJob, seq: SequenceCache, cached: int) -> None:
        bs = self.cache.block_size
        for i in range(cached // bs, len(job.block_keys)):
            if not self.store.contains(job.block_keys[i]):
                self.store.put(job.block_keys[i], payload_of_block(self.model, self.cache, seq, i))
