"""A modelled decode worker: pages reserved per request, a continuous batch of at most
``max_batch`` requests, and a step time from the cost model.

The batch advances in segments: while no request joins or leaves, ``k`` steps take
``k * decode_step_s(batch, context at the segment's middle)`` (exact for the fitted model,
which is linear in the context), and every request in the batch gets one token per step. A
request that arrives mid-segment joins at the end of the step in progress::

    segment start          join at t             step boundary b       segment end (cancelled)
    |---- step ----|---- step --|- ...           |                     |
                                 ^ waits until b, when the batch is re-formed
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from costmodel import CostModels
from decode_worker.config import DecodeConfig
from kvstore.index import WorkerLoad
from replay.sim.events import EventLoop


@dataclass
class SimDecodeRequest:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_generated: int = 1  # the prefill sampled the first token
    token_times_s: list[float] = field(default_factory=list)  # sim times of tokens 2..n

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.num_generated

    @property
    def context(self) -> int:
        return self.num_prompt_tokens + self.num_generated


class SimDecode:
    def __init__(self, worker_id: str, config: DecodeConfig, costs: CostModels, loop: EventLoop,
                 on_done: Callable[[SimDecodeRequest], None],
                 on_progress: Callable[[SimDecodeRequest], None] = lambda r: None):
        self.worker_id, self.config, self.costs, self.loop, self.on_done = worker_id, config, costs, loop, on_done
        self.on_progress = on_progress
        self.backend = config.transfer_backend
        self.num_free_pages = config.num_pages
        self.reserved: dict[str, int] = {}  # request id -> pages (reserved or decoding)
        self.waiting: deque[SimDecodeRequest] = deque()
        self.running: list[SimDecodeRequest] = []
        self._segment: tuple[float, float, int] | None = None  # (start, step_s, steps)
        self._generation = 0
        self._rebatch_at: float | None = None

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
            return
        if self._rebatch_at is not None:
            return
        start, step_s, steps = self._segment
        done = min(steps, math.floor((self.loop.now - start) / step_s) + 1)
        if done < steps:
            self._generation += 1  # the planned segment end no longer applies
            self._rebatch_at = start + done * step_s
            self.loop.at(self._rebatch_at, self._end_segment, self._generation, done)

    def _form_batch(self) -> None:
        while self.waiting and len(self.running) < self.config.max_batch:
            self.running.append(self.waiting.popleft())
        if not self.running:
            self._segment = None
            return
        batch = len(self.running)
        steps = min(r.remaining for r in self.running)
        mid_context = sum(r.context for r in self.running) + batch * (steps - 1) / 2
        step_s = self.costs.decode_step_s(batch, int(mid_context))
        self._segment = (self.loop.now, step_s, steps)
        self._generation += 1
        self.loop.at(self.loop.now + steps * step_s, self._end_segment, self._generation, steps)

    def _end_segment(self, generation: int, steps: int) -> None:
        if generation != self._generation or self._segment is None:
            return
        start, step_s, _ = self._segment
        times = [start + step_s * (i + 1) for i in range(steps)]
        for r in self.running:
            r.token_times_s.extend(times)
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
