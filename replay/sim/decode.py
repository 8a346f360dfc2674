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
with the receiver taking a prefill's pushed KV): the step in progress ends ``s`` later, and an
idle loop starts its next step ``s`` later. A token made at the end of a step reaches the
client ``delivery_delay_s(u)`` later, ``u`` drawn from the worker's seeded generator
(``ClusterOverheads``; no delay and no draw by default), and never before the request's
previous token: a stream is in order.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from costmodel import CostModels
from costmodel.overheads import NO_OVERHEADS, ClusterOverheads
from decode_worker.config import DecodeConfig
from kvstore.index import WorkerLoad
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
        self._rebatch_at: float | None = None
        self._paused_until = 0.0  # no step starts before this
        self._resume_from_s: float | None = None  # a stalled step's clock: the next segment starts here
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

    def stall(self, seconds: float) -> None:
        """The loop loses ``seconds`` from now: the step in progress ends that much later (its
        progress so far kept), or, with no step running, the next one starts that much later."""
        if seconds <= 0:
            return
        now = self.loop.now
        if self._segment is None:
            self._paused_until = max(self._paused_until, now) + seconds
            return
        start, step_s, steps = self._segment
        done = max(0, min(steps, math.floor((now - start) / step_s)))
        self._generation += 1  # the planned segment end (or re-batching) no longer applies
        self._resume_from_s = start + done * step_s + seconds
        self._end_segment(self._generation, done)

    def _cut(self) -> None:
        """Ends the running segment at the end of the step in progress (see the module docstring)."""
        start, step_s, steps = self._segment
        if self._rebatch_at is not None:
            return
        done = max(0, min(steps, math.floor((self.loop.now - start) / step_s) + 1))
        if done < steps:
            self._generation += 1  # the planned segment end no longer applies
            self._rebatch_at = start + done * step_s
            self.loop.at(self._rebatch_at, self._end_segment, self._generation, done)

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
        # After a stall the step in progress goes on from where it was, ``seconds`` later: the
        # segment starts at its (shifted) beginning, maybe past, and its first step ends later.
        start = self.loop.now if self._resume_from_s is None else self._resume_from_s
        self._resume_from_s = None
        self._segment = (start, step_s, steps)
        self._generation += 1
        self.loop.at(start + steps * step_s, self._end_segment, self._generation, steps)

    def _end_segment(self, generation: int, steps: int) -> None:
        if generation != self._generation or self._segment is None:
            return
        start, step_s, _ = self._segment
        times = [start + step_s * (i + 1) for i in range(steps)]
        for r in self.running:
            self._deliver(r, times)
            r.num_generated += steps
            if r.remaining > 0:
                self.on_progress(r)
        finished = [r for r in self.running if r.remaining <= 0]
        self.running = [r for r in self.running if r.remaining > 0]
        self._segment, self._rebatch_at = None, None
        for r in finished:
            self.release(r.request_id)
            self.on_done(r)
        self._form_batch()

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
