"""Continuous batching: the decode loop and the cache it owns.

Owns the worker's ``CacheManager`` and the set of requests in it. Requests pass through
three states: *reserved* (pages and a KDA slot held, KV arriving), *running* (in the batch;
every step feeds each its last token) and gone (released). Requests join and leave the batch
at every step. Each running request has an output queue that receives token lists and then
exactly one terminal item.

Locking: one lock guards the cache manager and the request table; the loop holds it for the
bookkeeping around a step but not while the model runs. The KV of a reserved request is
written by the transfer receiver's thread into pages that no step touches until the request
is running.

Metrics (``decode_worker.metrics.DecodeMetrics``, optional): the loop reports each step's
duration and batch size; the gauges are read from ``load()`` when Prometheus scrapes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from decode_worker.metrics import DecodeMetrics
from engine import CacheManager, HybridModel, SamplingParams, SequenceCache, sample
from kvstore.index import WorkerLoad

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    """Terminal item of an output queue: ``reason`` is stop | length | cancelled | failed."""

    reason: str
    error: str = ""


@dataclass
class _Running:
    seq: SequenceCache
    params: SamplingParams
    last_token: int
    num_generated: int  # tokens produced so far, counting the first one (from prefill)
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: bool = False


@dataclass
class _Reserved:
    seq: SequenceCache
    expires_at: float


class DecodeScheduler:
    def __init__(self, model: HybridModel, num_pages: int, num_slots: int, block_size: int,
                 max_batch: int = 32, reservation_ttl_s: float = 120.0, metrics: DecodeMetrics | None = None):
        self.model = model
        self.cache: CacheManager = model.new_cache(num_pages, num_slots, block_size)
        self.max_batch = max_batch
        self.reservation_ttl_s = reservation_ttl_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._reserved: dict[str, _Reserved] = {}
        self._waiting: list[_Running] = []
        self._running: dict[str, _Running] = {}
        self._stop = False
        self.draining = False
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self.metrics = metrics or DecodeMetrics.disabled()
        self.metrics.watch(self)

    # ---- called from RPC handlers ---------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def try_reserve(self, request_id: str, num_tokens: int) -> SequenceCache | None:
        """Pages for num_tokens plus a KDA slot, or None when they do not fit now (or the
        worker is draining)."""
        with self._lock:
            if request_id in self._reserved or request_id in self._running:
                raise ValueError(f"request {request_id!r} is already on this worker")
            if self.draining:
                return None
            seq = self.cache.try_reserve(request_id, num_tokens)
            if seq is not None:
                self._reserved[request_id] = _Reserved(seq, time.monotonic() + self.reservation_ttl_s)
            return seq

    def start_decoding(self, request_id: str, num_prompt_tokens: int, first_token: int,
                       params: SamplingParams) -> queue.Queue:
        """Moves a reserved request (its KV fully received) into the batch; returns its queue."""
        with self._lock:
            res = self._reserved.pop(request_id, None)
            if res is None:
                raise ValueError(f"request {request_id!r} holds no reservation here (expired or released)")
            res.seq.num_tokens = num_prompt_tokens
            run = _Running(res.seq, params, first_token, 1)
            self._waiting.append(run)
            self._wake.notify()
            return run.out

    def release(self, request_id: str) -> bool:
        """Frees the request wherever it is; a running one ends with 'cancelled'. Idempotent."""
        with self._lock:
            res = self._reserved.pop(request_id, None)
            if res is not None:
                self.cache.release(res.seq)
                return True
            for run in [*self._waiting, *self._running.values()]:
                if run.seq.request_id == request_id:
                    run.cancelled = True
                    self._wake.notify()
                    return True
            return False

    def load(self) -> WorkerLoad:
        """Reserved and waiting requests count as queued (joining); the heartbeat payload."""
        with self._lock:
            running = list(self._running.values())
            ids = [*self._reserved, *(r.seq.request_id for r in self._waiting), *(r.seq.request_id for r in running)]
            return WorkerLoad(
                num_queued=len(self._reserved) + len(self._waiting), num_running=len(running),
                num_free_pages=self.cache.pool.num_free,
                num_context_tokens=sum(r.seq.num_tokens for r in running),
                request_ids=tuple(ids), timestamp_s=time.time(),
            )

    def drain(self, timeout_s: float) -> None:
        """Refuses new reservations and waits until every held request has ended."""
        until = time.monotonic() + timeout_s
        with self._lock:
            self.draining = True
            while (self._reserved or self._waiting or self._running) and time.monotonic() < until:
                self._wake.wait(min(0.1, max(0.0, until - time.monotonic())))

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def check_integrity(self) -> None:
        with self._lock:
            self.cache.check_integrity()

    # ---- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._waiting and not self._running:
                    self._wake.wait(timeout=1.0)
                    self._expire_reservations()
                if self._stop:
                    self._fail_all("worker shutting down")
                    return
                batch = self._admit()
            if batch:
                try:
                    self._step(batch)
                except Exception as e:  # outermost boundary of the loop: fail the batch, keep serving
                    log.exception("decode step failed")
                    with self._lock:
                        for run in batch:
                            self._finish(run, Finished("failed", f"decode step failed: {e}"))

    def _admit(self) -> list[_Running]:
        """Drops cancelled requests, moves waiting ones into the batch, grows pages. Under lock."""
        self._expire_reservations()
        for run in [r for r in self._running.values() if r.cancelled]:
            self._finish(run, Finished("cancelled"))
        while self._waiting and len(self._running) < self.max_batch:
            run = self._waiting.pop(0)
            if run.cancelled:
                self.cache.release(run.seq)
                run.out.put(Finished("cancelled"))
                continue
            self._running[run.seq.request_id] = run
        for run in list(self._running.values()):
            if not self.cache.try_extend(run.seq, run.seq.num_tokens + 1):
                # Pages were reserved for prompt + max_tokens at admission, so this is a bug.
                self._finish(run, Finished("failed", "out of cache pages"))
        return list(self._running.values())

    @torch.inference_mode()
    def _step(self, batch: list[_Running]) -> None:
        t0 = time.perf_counter()
        logits = self.model.decode_step(self.cache, [r.seq for r in batch], [r.last_token for r in batch])
        tokens = sample(logits, [r.params for r in batch], [r.seq.num_tokens for r in batch])
        self.metrics.step(len(batch), time.perf_counter() - t0)
        with self._lock:
            for run, tok in zip(batch, tokens, strict=True):
                if run.seq.request_id not in self._running:
                    continue
                run.last_token = tok
                run.num_generated += 1
                run.out.put([tok])
                if tok in run.params.stop_token_ids:
                    self._finish(run, Finished("stop"))
                elif run.num_generated >= run.params.max_new_tokens:
                    self._finish(run, Finished("length"))

    def _finish(self, run: _Running, item: Finished) -> None:
        """Removes a request from the batch, frees its cache and posts its terminal item. Under lock."""
        self._running.pop(run.seq.request_id, None)
        self.cache.release(run.seq)
        run.out.put(item)
        self._wake.notify_all()

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        for rid, res in list(self._reserved.items()):
            if res.expires_at < now:
                log.warning("reservation %s expired without a decode call; freeing it", rid)
                del self._reserved[rid]
                self.cache.release(res.seq)

    def _fail_all(self, reason: str) -> None:
        for run in [*self._waiting, *self._running.values()]:
            self.cache.release(run.seq)
            run.out.put(Finished("failed", reason))
        self._waiting.clear()
        self._running.clear()
