"""A modelled decode worker: pages reserved per request, a continuous batch of at most
``max_batch`` requests, and a step time from the cost model (times the live cluster's
``decode_step_scale``, 1 by default).

The batch advances in segments: while no request joins or leaves, ``k`` steps take
``k * decode_step_s(batch, context at the segment's middle)`` (exact for the fitted model,
which is linear in the context), and every request in the batch gets one token per step. A
request that arrives mid-segment joins at the end of the step in progress::

    segment start          join at t             step boundary b       segment end (cancelled)
    |---- step ----|---- step --|- ...           |                     |
                                 ^ waits until b, when the batch is re-formed

``stall(s)`` costs the loop ``s`` from now (a live decode worker's loop shares its process
with the receiver taking a prefill's pushed KV and with the RPC handlers, and its cores with
the host's other processes): the steps made so far keep their times, and the step in
progress and the rest of the segment end ``s`` later with the same batch, so a request
waiting to join still waits for the step in progress; an idle loop starts its next step
``s`` later (unless the stall is work only a running step waits for)::

    before:  |-- step --|-- st.|.ep --|-- step --|
                         stall ^
    after:   |-- step --|-- st.|<- s ->|.ep --|-- step --|

A token made at the end of a step reaches the client ``delivery_delay_s(u)`` later, ``u``
drawn from the worker's seeded generator (``ClusterOverheads``; no delay and no draw by
default), and never before the request's previous token: a stream is in order.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from clusterstate.workers import WorkerLoad
from costmodel import CostModels
from costmodel.overheads import NO_OVERHEADS, ClusterOverheads
from decode_worker.config import DecodeConfig
from replay.sim.events import EventLoop


@dataclass
class SimDecodeRequest:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_generated: int = 1  # the prefill sampled the first token
    token_times_s: list[float] = field(default_factory=list)  # sim times tokens 2..n reach the client

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.num_generated

    @property
    def context(self) -> int:
        return self.num_prompt_tokens + self.num_generated


class SimDecode:
    def __init__(self, worker_id: str, config: DecodeConfig, costs: CostModels, loop: EventLoop,
                 on_done: Callable[[SimDecodeRequest], None],
                 on_progress: Callable[[SimDecodeRequest], None] = lambda r: None,
                 overheads: ClusterOverheads = NO_OVERHEADS, seed: int = 0):
        self.worker_id, self.config, self.costs, self.loop, self.on_done = worker_id, config, costs, loop, on_done
        self.on_progress, self.overheads = on_progress, overheads
        self._rng = random.Random(f"{seed}/{worker_id}")  # delivery delays; drawn in event order: deterministic
        self.backend = config.transfer_backend
        self.num_free_pages = config.num_pages
        self.reserved: dict[str, int] = {}  # request id -> pages (reserved or decoding)
        self.waiting: deque[SimDecodeRequest] = deque()
        self.running: list[SimDecodeRequest] = []
        self._segment: tuple[float, float, int] | None = None  # (start, step_s, steps)
        self._generation = 0
        self._cut_steps: int | None = None  # a join re-forms the batch after this many of the segment's steps
        self._paused_until = 0.0  # no step starts before this
        self._resume_at: float | None = None  # a scheduled _form_batch at the pause's end

    @property
    def idle(self) -> bool:
        return not self.reserved and not self.running and not self.waiting

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.config.block_size)

    def try_reserve(self, request_id: str, num_tokens: int) -> bool:
        need = self.pages_for(num_tokens)
        if need > self.num_free_pages or len(self.reserved) >= self.config.num_slots:
            return False
        self.reserved[request_id] = need
        self.num_free_pages -= need
        return True

    def release(self, request_id: str) -> None:
        self.num_free_pages += self.reserved.pop(request_id, 0)

    def load(self) -> WorkerLoad:
        decoding = {r.request_id for r in self.running}
        return WorkerLoad(num_queued=len(self.reserved) - len(decoding), num_running=len(self.running),
                          num_free_pages=self.num_free_pages, num_context_tokens=sum(r.context for r in self.running),
                          request_ids=tuple(self.reserved), timestamp_s=self.loop.clock.wall())

    # ---- the batch ----------------------------------------------------------------------------
    def join(self, request: SimDecodeRequest) -> None:
        """The request's KV has arrived: it enters the batch at the next step boundary."""
        self.waiting.append(request)
        if self._segment is None:
            self._form_batch()
        else:
            self._cut()

    def stall(self, seconds: float, when_idle: bool = True) -> None:
        """The loop loses ``seconds`` from now: the steps made so far keep their times and the
        rest of the segment, the step in progress included, ends that much later with the same
        batch; with no step running, the next one starts that much later (not with
        ``when_idle=False``: work that only the steps in progress wait for)."""
        if seconds <= 0:
            return
        now = self.loop.now
        if self._segment is not None:
            start, step_s, steps = self._segment
            # now < start only after an earlier stall, while the segment's first step is in progress
            done = max(0, math.floor((now - start) / step_s))
            if done < steps:
                self._advance(start, step_s, done)
                self._segment = (start + done * step_s + seconds, step_s, steps - done)
                self._schedule_end(None if self._cut_steps is None else self._cut_steps - done)
                return
        # Idle, or the segment's last step is over (its end is due now): the next step waits.
        if when_idle:
            self._paused_until = max(self._paused_until, now) + seconds

    def _cut(self) -> None:
        """Ends the running segment at the end of the step in progress (see the module docstring)."""
        if self._cut_steps is not None:
            return
        start, step_s, steps = self._segment
        # At least one step: before the segment's start (a stalled one) its first step is in progress.
        done = min(steps, max(1, math.floor((self.loop.now - start) / step_s) + 1))
        if done < steps:
            self._schedule_end(done)

    def _schedule_end(self, cut_steps: int | None) -> None:
        """(Re)plans the running segment's end: after ``cut_steps`` steps, or all of them."""
        start, step_s, steps = self._segment
        self._cut_steps = cut_steps
        self._generation += 1  # an end planned before no longer applies
        n = steps if cut_steps is None else cut_steps
        self.loop.at(start + n * step_s, self._end_segment, self._generation, n)

    def _resume(self) -> None:
        self._resume_at = None
        self._form_batch()

    def _form_batch(self) -> None:
        if self.loop.now < self._paused_until:
            self._segment = None
            if self._resume_at is None:
                self._resume_at = self._paused_until
                self.loop.at(self._paused_until, self._resume)
            return
        while self.waiting and len(self.running) < self.config.max_batch:
            self.running.append(self.waiting.popleft())
        if not self.running:
            self._segment = None
            return
        batch = len(self.running)
        steps = min(r.remaining for r in self.running)
        mid_context = sum(r.context for r in self.running) + batch * (steps - 1) / 2
        step_s = self.overheads.decode_step_s(self.costs.decode_step_s(batch, int(mid_context)))
        self._segment = (self.loop.now, step_s, steps)
        self._schedule_end(None)

    def _end_segment(self, generation: int, steps: int) -> None:
        if generation != self._generation or self._segment is None:
            return
        start, step_s, _ = self._segment
        self._advance(start, step_s, steps)
        finished = [r for r in self.running if r.remaining <= 0]
        self.running = [r for r in self.running if r.remaining > 0]
        self._segment, self._cut_steps = None, None
        for r in finished:
            self.release(r.request_id)
            self.on_done(r)
        self._form_batch()

    def _advance(self, start: float, step_s: float, steps: int) -> None:
        """The batch's first ``steps`` steps from ``start``: a token each per step."""
        if steps <= 0:
            return
        times = [start + step_s * (i + 1) for i in range(steps)]
        delayed, on_progress = bool(self.overheads.delivery_delay_quantiles_s), self.on_progress
        for r in self.running:
            if delayed:
                self._deliver(r, times)
            else:
                r.token_times_s.extend(times)
            r.num_generated += steps
            if r.max_tokens > r.num_generated:  # r.remaining > 0, inline: per request per segment
                on_progress(r)

    def _deliver(self, request: SimDecodeRequest, made_s: list[float]) -> None:
        """Appends when the tokens made at ``made_s`` reach the client (see the module docstring)."""
        if not self.overheads.delivery_delay_quantiles_s:
            request.token_times_s.extend(made_s)
            return
        out, delay = request.token_times_s, self.overheads.delivery_delay_s
        last = out[-1] if out else 0.0
        for t in made_s:
            last = max(last, t + delay(self._rng.random()))
            out.append(last)
