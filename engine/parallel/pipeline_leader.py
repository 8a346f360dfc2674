"""Rank 0 of a pipelined (CPP) prefill instance: ``PipelineModel``, the model the prefill
worker sees, and its side of each prefill (``engine.parallel.pipeline`` has the layout).

Rank 0 posts its receives for chunk k before computing it (so a later stage never waits to send)
and takes chunk k-1's results after handing chunk k on. A prefill that is not pipelined (the
Conductor's choice for a short prompt, ``pipeline_chunk_tokens`` 0) is one chunk passing the
stages in turn. A layer hook that raises on rank 0 stops the pipeline at the next chunk: rank 0
sends stop instead of it, takes the results of the chunks already sent, and raises.
Thread-safe: one op at a time.
"""

from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from engine.cache import CacheManager, SequenceCache
from engine.model import HybridModel, LayerHook
from engine.parallel.comm import GroupFailed
from engine.parallel.face import Face
from engine.parallel.group import Channel
from engine.parallel.leader import DeferredHook
from engine.parallel.ops import ALL_LOGITS, SYNC, Op
from engine.parallel.pipeline import (
    DATA,
    FINAL_TAG,
    STOP,
    PrefillPlan,
    StageLayers,
    irecv,
    isend,
    run_stage_chunk,
    sync_stages,
    tag,
    wait,
)

log = logging.getLogger(__name__)


class PipelineModel(Face):
    """Rank 0 (stage 0) of a pipelined prefill instance, in the shape of ``HybridModel``'s
    prefill interface. ``stage``: rank 0's model (its layers, the embedding); ``stages``: every
    stage's layers, in order."""

    supports_decode = False
    pipelined = True

    def __init__(self, stage: HybridModel, channel: Channel, stages: Sequence[StageLayers],
                 on_failure: Callable[[str], None] | None = None, keepalive_s: float = 0.0):
        super().__init__(channel, on_failure, keepalive_s)
        self.stage, self.stages = stage, list(stages)
        self.cfg, self.fingerprint, self.device, self.dtype = stage.cfg, stage.fingerprint, stage.device, stage.dtype
        self.prefill_chunk_tokens = stage.prefill_chunk_tokens
        self.tokenizer = None
        self.plan = stage.plan
        self._caches: weakref.WeakKeyDictionary[CacheManager, int] = weakref.WeakKeyDictionary()

    def new_cache(self, num_pages: int, num_slots: int, block_size: int) -> CacheManager:
        """A canonical cache of every layer (rank 0's); each later stage keeps its own."""
        with self._lock:
            cache = CacheManager(self.cfg, num_pages, num_slots, block_size, self.dtype, self.device)
            cache_id = self._new_cache_id()
            self._send(Op.NEW_CACHE, cache_id, num_pages, num_slots, block_size)
            self._caches[cache] = cache_id
            weakref.finalize(cache, self._dropped.append, cache_id)
            return cache

    def decode_step(self, cache: CacheManager, seqs: Sequence[SequenceCache], token_ids: Sequence[int]):
        raise NotImplementedError("a pipelined (CPP) instance prefills only; decode runs on decode instances")

    # ---- prefill --------------------------------------------------------------------------------
    def prefill(self, cache: CacheManager, seq: SequenceCache, token_ids: Sequence[int], *,
                all_logits: bool = False, chunk_tokens: int | None = None, snapshot_at: Sequence[int] = (),
                on_layer: LayerHook | None = None, on_chunk: Callable[[int, int], None] | None = None,
                pipeline_chunk_tokens: int = 0) -> torch.Tensor:
        """``HybridModel.prefill`` through the stages, in pipeline chunks of
        ``pipeline_chunk_tokens`` (0: one chunk, the stages in turn). ``on_chunk`` is not
        supported (no caller of a pipelined instance needs it)."""
        if on_chunk is not None:
            raise ValueError("on_chunk is not supported by a pipelined instance")
        with self._lock:
            cache_id = self._caches.get(cache)
            if cache_id is None:
                raise ValueError("this cache was not made by this instance's new_cache")
            bs, start, n = cache.block_size, seq.num_tokens, len(token_ids)
            end = start + n
            if end > len(seq.pages) * bs:
                raise ValueError(f"request {seq.request_id}: {end} tokens need more than its {len(seq.pages)} pages")
            copies = []
            for i in range(start // bs, -(-end // bs)):
                before = seq.pages[i]
                cache.ensure_writable(seq, i)
                if seq.pages[i] != before:
                    copies += [before, seq.pages[i]]
            sync = start > 0 and not self._is_current(seq)
            points = tuple(sorted({int(p) for p in snapshot_at if start < p <= end}))
            plan = PrefillPlan(start, end, pipeline_chunk_tokens or n, chunk_tokens, points, all_logits)
            flags = (ALL_LOGITS if all_logits else 0) | (SYNC if sync else 0)
            self._send(Op.CPP_PREFILL, cache_id, seq.slot, start, n, len(seq.pages), len(points), chunk_tokens or 0,
                       flags, len(copies) // 2, plan.pipe_tokens,
                       ints=[*seq.pages, *map(int, token_ids), *points, *copies])
            log.info("request %s: %d tokens %s over %d stages", seq.request_id, n,
                     f"pipelined in chunks of {pipeline_chunk_tokens}" if pipeline_chunk_tokens else "in one chunk",
                     len(self.stages))
            try:
                if sync:
                    sync_stages(self.channel, cache, seq, start, canonical=True)
                logits = _Leader(self, cache, seq, plan, on_layer).run(torch.as_tensor(list(token_ids)))
            except GroupFailed as e:
                self._fail(e)
                raise
            self._mark_current(seq)
            return logits


class _Leader:
    """Rank 0's side of one pipelined prefill (see the module docstring)."""

    def __init__(self, owner: PipelineModel, cache: CacheManager, seq: SequenceCache, plan: PrefillPlan,
                 on_layer: LayerHook | None):
        self.owner, self.cache, self.seq, self.plan = owner, cache, seq, plan
        self.model = owner.stage
        self.hook = DeferredHook(on_layer)
        self.later = owner.stages[1:]
        self.last = len(owner.stages) - 1
        self.logits: list[torch.Tensor] = []
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def run(self, ids: torch.Tensor) -> torch.Tensor:
        plan, seq = self.plan, self.seq
        prefixes = self.model.expanded_prefixes(self.cache, seq, plan.end)
        pending: collections.deque = collections.deque()
        stopped = False
        for k, (lo, hi) in enumerate(plan.chunks()):
            if self.hook.raised:
                self._send_to_next(k, torch.tensor([STOP]))
                stopped = True
                break
            receives = self._post(k, lo, hi)
            snaps: dict[int, tuple] = {}
            h = run_stage_chunk(self.model, self.cache, seq, ids[lo - plan.start : hi - plan.start], lo, plan,
                                prefixes, self.hook, snaps)
            seq.snapshots.update(snaps)  # rank 0's layers; the later stages' parts come with their results
            self._send_to_next(k, torch.tensor([DATA]), h)
            if pending:
                self._take(*pending.popleft())
            pending.append((k, lo, hi, receives))
        while pending:
            self._take(*pending.popleft())
        for work, _ in self._sends:
            wait(work)
        if stopped:
            raise self.hook.raised[0]
        last_logits = self._finals()
        if self.hook.raised:
            raise self.hook.raised[0]
        return torch.cat(self.logits) if plan.all_logits else last_logits

    def _send_to_next(self, k: int, flag: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        self._sends.append((isend(flag, 1, tag(k, 0)), flag))
        if hidden is not None:
            hidden = hidden.contiguous()
            self._sends.append((isend(hidden, 1, tag(k, 1)), hidden))

    def _post(self, k: int, lo: int, hi: int) -> list[tuple[int, str, torch.Tensor, dist.Work]]:
        """Receives of chunk k's results from every later stage, posted before computing it."""
        kv, slots = self.cache.pool.kv, self.cache.slots
        n_points = len(self.plan.points_in(lo, hi))
        out = []
        for s, stage in enumerate(self.later, start=1):
            bufs = []
            if stage.mla:
                bufs.append(("rows", kv.new_empty((len(stage.mla), hi - lo, kv.shape[-1])), 2))
            if stage.kda and n_points:
                bufs.append(("state", slots.state.new_empty((n_points, len(stage.kda), *slots.state.shape[2:])), 4))
                bufs.append(("conv", slots.conv.new_empty((n_points, len(stage.kda), *slots.conv.shape[2:])), 5))
            if s == self.last and self.plan.all_logits:
                bufs.append(("logits", torch.empty(hi - lo, self.cfg_vocab, dtype=torch.float32), 3))
            out += [(s, name, buf, irecv(buf, s, tag(k, kind))) for name, buf, kind in bufs]
        return out

    @property
    def cfg_vocab(self) -> int:
        return self.owner.cfg.vocab_size

    def _take(self, k: int, lo: int, hi: int, receives) -> None:
        """Chunk k's results: rows into the canonical pages (then the layer hook, as if rank 0
        had computed them), snapshot parts, logits."""
        points = self.plan.points_in(lo, hi)
        got: dict[tuple[int, str], torch.Tensor] = {}
        for s, name, buf, work in receives:
            wait(work)
            got[(s, name)] = buf
        for s, stage in enumerate(self.later, start=1):
            if (s, "rows") in got:
                for j, index in enumerate(stage.mla):
                    self.cache.write_rows(self.seq, index, lo, got[(s, "rows")][j])
            for layer in stage.layers:
                self.hook(layer, lo, hi)
            if (s, "state") in got:
                for j, point in enumerate(points):
                    state, conv = self.seq.snapshots[point]
                    state[list(stage.kda)] = got[(s, "state")][j]
                    conv[list(stage.kda)] = got[(s, "conv")][j]
            if (s, "logits") in got:
                self.logits.append(got[(s, "logits")])

    def _finals(self) -> torch.Tensor:
        """Every later stage's final KDA state into the canonical slot; the last stage's logits."""
        slots, slot = self.cache.slots, self.seq.slot
        for s, stage in enumerate(self.later, start=1):
            if stage.kda:
                state = slots.state.new_empty((len(stage.kda), *slots.state.shape[2:]))
                conv = slots.conv.new_empty((len(stage.kda), *slots.conv.shape[2:]))
                wait(irecv(state, s, FINAL_TAG))
                wait(irecv(conv, s, FINAL_TAG + 1))
                slots.state[list(stage.kda), slot] = state
                slots.conv[list(stage.kda), slot] = conv
        logits = torch.empty(1, self.cfg_vocab, dtype=torch.float32)
        if not self.plan.all_logits:
            wait(irecv(logits, self.last, FINAL_TAG + 2))
        return logits
