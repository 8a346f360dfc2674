"""Continuous batching: the decode loop and the cache it owns.

Owns the worker's ``CacheManager`` and the set of requests in it. Requests pass through
three states: *reserved* (pages and a KDA slot held, KV arriving), *running* (in the batch;
every step feeds each its last token) and gone (released). Requests join and leave the batch
at every step. Each running request has an output queue (``TokenQueue``) that receives token
lists and then exactly one terminal item; ``take_ready`` is how a reader takes them, every
token queued so far at once.

Locking: one lock guards the cache manager and the request table; the loop holds it for the
bookkeeping around a step but not while the model runs. The KV of a reserved request is
written by the transfer receiver's thread into pages that no step touches until the request
is running.

A reservation whose ``Decode`` call never comes (its Conductor died) expires
``reservation_ttl_s`` after its last sign of life: the reservation, its Conductor's ``renew``
(a live Conductor renews what it holds, ``conductor.grpc_dispatch.ReservationLeases``), or its
KV still arriving (``ReservationTransfers.receiving``). One whose transfer failed
(``ReservationTransfers.failure``: the prefill worker's ABORT, which a prefill whose Conductor
left sends, or its connection's loss) is freed at the next check, within ``EXPIRY_CHECK_S``.
Its pages are freed only once the receiver has forgotten it (``ReservationTransfers.cancel``,
which waits out a sender still writing into them), so the KV of a prefill that runs after the
expiry can never land in pages another request holds by then: it is refused, and that
placement fails.

Per step, the loop's own Python work that grows with the batch is handing each request its
token (a C-level queue put, a fraction of a microsecond) and the length and stop checks; the
rest is O(requests that join or leave). Cache pages for a request's whole decode are made sure
of once, when it joins (``start_decoding``), not at every step.

Metrics (``decode_worker.metrics.DecodeMetrics``, optional): the loop reports each step's
duration and batch size; the gauges are read from ``load()`` when Prometheus scrapes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from clusterstate.workers import WorkerLoad
from decode_worker.metrics import DecodeMetrics
from engine import CacheManager, HybridModel, SamplingParams, SequenceCache, sample
from runtime.errors import Conflict, NoReservation

log = logging.getLogger(__name__)

EXPIRY_CHECK_S = 1.0  # how often the loop looks for expired reservations (their TTL is minutes)
MAX_TOKENS_PER_TAKE = 4096  # most tokens ``take_ready`` returns at once: one message stays far below gRPC's 4 MiB


@dataclass(frozen=True)
class Finished:
    """Terminal item of an output queue: ``reason`` is stop | length | cancelled | failed."""

    reason: str
    error: str = ""


class TokenQueue(queue.SimpleQueue):
    """One request's output: lists of token ids, then exactly one ``Finished``. One producer
    (the loop) and one reader. ``SimpleQueue``'s put and get are C code: a put costs the loop
    about 0.2 us where ``queue.Queue``'s Python locking cost 1 to 2 us, and it wakes a waiting
    reader directly. A subclass only so that an instance takes attributes (benches wrap
    ``put`` to stamp hand-over times)."""


def take_ready(out: TokenQueue, timeout_s: float,
               max_tokens: int = MAX_TOKENS_PER_TAKE) -> tuple[list[int], Finished | None] | None:
    """Waits up to ``timeout_s`` for the next item, then takes every item already queued behind
    it without waiting more: (tokens, the terminal item or None), or None when nothing came.

    A reader that keeps up gets each step's token alone, as soon as the loop hands it over:
    nothing, the first token least of all, is held back to fill a batch. A reader that fell
    behind (a slow client, a busy core) gets everything it missed in one batch, so a slow
    stream costs one message per catch-up rather than one per token. At most ``max_tokens``
    tokens; the rest stay queued for the next call."""
    try:
        item = out.get(timeout=timeout_s)
    except queue.Empty:
        return None
    tokens: list[int] = []
    while not isinstance(item, Finished):
        tokens.extend(item)
        if len(tokens) >= max_tokens or out.empty():
            return tokens, None
        item = out.get_nowait()  # one reader: what empty() saw is still there
    return tokens, item


@dataclass
class _Running:
    seq: SequenceCache
    params: SamplingParams
    last_token: int
    num_generated: int  # tokens produced so far, counting the first one (from prefill)
    out: TokenQueue = field(default_factory=TokenQueue)
    cancelled: bool = False  # released while waiting to join (a running one is in ``_cancelled``)


@dataclass
class _Reserved:
    seq: SequenceCache
    expires_at: float


class ReservationTransfers(Protocol):
    """What the scheduler asks of the transfer receiver about a reservation (``Receiver``)."""

    def receiving(self, request_id: str) -> bool:
        """Its KV is arriving: frames came and it is neither complete nor failed."""

    def failure(self, request_id: str) -> str | None:
        """Why its transfer failed (its sender aborted, died, sent something wrong, or its
        deadline passed), else None: a failed one never completes, so no Decode call can use
        the reservation."""

    def cancel(self, request_id: str) -> None:
        """Forget it; returns once no sender may write into its destination."""


class DecodeScheduler:
    def __init__(self, model: HybridModel, num_pages: int, num_slots: int, block_size: int,
                 max_batch: int = 32, reservation_ttl_s: float = 30.0, metrics: DecodeMetrics | None = None,
                 transfers: ReservationTransfers | None = None):
        """``transfers``: the receiver writing the reservations' KV (None: nothing does, as in
        unit tests; an expired reservation's pages are then freed at once)."""
        self.model = model
        self.transfers = transfers
        self.cache: CacheManager = model.new_cache(num_pages, num_slots, block_size)
        self.max_batch = max_batch
        self.reservation_ttl_s = reservation_ttl_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._reserved: dict[str, _Reserved] = {}
        self._waiting: list[_Running] = []
        self._running: dict[str, _Running] = {}
        self._cancelled: set[str] = set()  # running requests released since the last step
        self._next_expiry_check = 0.0
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
                raise Conflict(f"request {request_id!r} is already on this worker")
            if self.draining:
                return None
            seq = self.cache.try_reserve(request_id, num_tokens)
            if seq is not None:
                self._reserved[request_id] = _Reserved(seq, time.monotonic() + self.reservation_ttl_s)
            return seq

    def renew(self, request_ids: list[str]) -> list[str]:
        """Each reservation among ``request_ids`` lives another ``reservation_ttl_s`` (its
        Conductor is alive and still holds it); returns the ids this worker holds nothing
        for (expired, released, never reserved). A request already decoding is not unknown."""
        now = time.monotonic()
        unknown = []
        with self._lock:
            waiting = {run.seq.request_id for run in self._waiting}
            for rid in request_ids:
                res = self._reserved.get(rid)
                if res is not None:
                    res.expires_at = max(res.expires_at, now + self.reservation_ttl_s)
                elif rid not in self._running and rid not in waiting:
                    unknown.append(rid)
        return unknown

    def start_decoding(self, request_id: str, num_prompt_tokens: int, first_token: int,
                       params: SamplingParams) -> TokenQueue:
        """Moves a reserved request (its KV fully received) into the batch; returns its queue.
        Its pages must hold prompt + max_new_tokens tokens, as ``Reserve`` asks, which covers
        every position a step will feed: they are extended here if the reservation was smaller,
        and when the pool cannot, the queue holds only ``Finished("failed")``."""
        with self._lock:
            res = self._reserved.pop(request_id, None)
            if res is None:
                raise NoReservation(f"request {request_id!r} holds no reservation here (expired or released)")
            res.seq.num_tokens = num_prompt_tokens
            run = _Running(res.seq, params, first_token, 1)
            # Made sure of once here, so that no step has to check or grow pages.
            if not self.cache.try_extend(res.seq, num_prompt_tokens + params.max_new_tokens):
                self.cache.release(res.seq)
                run.out.put(Finished("failed", "out of cache pages"))
                return run.out
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
            if request_id in self._running:
                self._cancelled.add(request_id)
                self._wake.notify()
                return True
            for run in self._waiting:
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
                            if self._running.get(run.seq.request_id) is run:  # one terminal each
                                self._finish(run, Finished("failed", f"decode step failed: {e}"))

    def _admit(self) -> list[_Running]:
        """Drops cancelled requests, moves waiting ones into the batch. Under lock. O(requests
        that leave or join), plus the batch list itself."""
        if time.monotonic() >= self._next_expiry_check:
            self._expire_reservations()
            self._next_expiry_check = time.monotonic() + EXPIRY_CHECK_S
        for rid in self._cancelled:
            run = self._running.get(rid)
            if run is not None:  # else it ended (stop, length) in the step that ran meanwhile
                self._finish(run, Finished("cancelled"))
        self._cancelled.clear()
        while self._waiting and len(self._running) < self.max_batch:
            run = self._waiting.pop(0)
            if run.cancelled:
                self.cache.release(run.seq)
                run.out.put(Finished("cancelled"))
                continue
            self._running[run.seq.request_id] = run
        return list(self._running.values())

    @torch.inference_mode()
    def _step(self, batch: list[_Running]) -> None:
        t0 = time.perf_counter()
        logits = self.model.decode_step(self.cache, [r.seq for r in batch], [r.last_token for r in batch])
        tokens = sample(logits, [r.params for r in batch], [r.seq.num_tokens for r in batch])
        self.metrics.step(len(batch), time.perf_counter() - t0)
        with self._lock:
            # Only this thread takes requests out of the batch, so every one is still in it.
            for run, tok in zip(batch, tokens, strict=True):
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
        """Under lock: reservations past their TTL leave the table, and so do those whose KV
        transfer failed (its sender's ABORT among the causes: no Decode call can use them);
        KV still arriving renews one. Their pages are freed here without a receiver, else by a
        thread once the receiver has forgotten them (``cancel`` may wait for a sender; the loop
        must not)."""
        now = time.monotonic()
        expired = []
        for rid, res in list(self._reserved.items()):
            failure = self.transfers.failure(rid) if self.transfers is not None else None
            if failure is None:
                if res.expires_at >= now:
                    continue
                if self.transfers is not None and self.transfers.receiving(rid):
                    res.expires_at = now + self.reservation_ttl_s
                    continue
                log.warning("reservation %s expired without a decode call; freeing it", rid)
                self.metrics.reservation_freed("expired")
            else:
                log.warning("reservation %s lost its KV transfer (%s); freeing it", rid, failure)
                self.metrics.reservation_freed("transfer_failed")
            del self._reserved[rid]
            expired.append((rid, res.seq))
        if not expired:
            return
        if self.transfers is None:
            for _, seq in expired:
                self.cache.release(seq)
            return
        threading.Thread(target=self._free_expired, args=(expired,), name="decode-expiry", daemon=True).start()

    def _free_expired(self, expired: list[tuple[str, SequenceCache]]) -> None:
        assert self.transfers is not None
        for rid, _ in expired:
            self.transfers.cancel(rid)
        with self._lock:
            for _, seq in expired:
                self.cache.release(seq)
            self._wake.notify_all()

    def _fail_all(self, reason: str) -> None:
        for run in [*self._waiting, *self._running.values()]:
            self.cache.release(run.seq)
            run.out.put(Finished("failed", reason))
        self._waiting.clear()
        self._running.clear()
        self._cancelled.clear()
