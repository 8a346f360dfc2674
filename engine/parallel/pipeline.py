"""Chunked pipeline parallelism (CPP, Mooncake FAST'25 §5.1): one prefill instance whose ranks
each compute a contiguous range of layers (a stage), a long prompt flowing through them in
chunks so that stage 1 works on chunk k while stage 0 works on chunk k+1::

    stage 0 (rank 0)   | chunk 0 | chunk 1 | chunk 2 | chunk 3 |
    stage 1 (rank 1)             | chunk 0 | chunk 1 | chunk 2 | chunk 3 |
                                 ^ hidden states of chunk 0 [T, hidden], point to point

Owns ``PipelineModel`` (rank 0: the model the prefill worker sees) and ``follow_prefill``
(a later stage's side of one prefill, run by its ``Follower``). Rank 0 holds the canonical
cache of every layer: each later stage sends back, per chunk, its MLA layers' rows (rank 0
writes them into the request's pages and fires the layer hook, so the worker pushes them to
the decode worker layer by layer as today and keeps whole blocks in its store), its KDA layers'
state at each snapshot point inside the chunk, and at the end its final state; the last stage
sends the logits. Every message goes by its own tag::

    chunk k, stage s-1 -> s     tag 8k: flag (1 data, 0 stop)   tag 8k+1: hidden [T, hidden]
    chunk k, stage s  -> 0      tag 8k+2: rows [n_mla(s), T, latent]   tag 8k+3: logits [T, vocab]
                                tag 8k+4 / 8k+5: KDA state / conv at the chunk's snapshot points
    end,     stage s  -> 0      FINAL+0 / +1: final KDA state / conv   FINAL+2: last logits

Rank 0 posts its receives for chunk k before computing it (so a later stage never waits to send)
and takes chunk k-1's results after handing chunk k on. A prefill that is not pipelined (the
Conductor's choice for a short prompt, ``pipeline_chunk_tokens`` 0) is one chunk passing the
stages in turn. Within a chunk each stage computes in the engine's own sub-chunks, cut at the
snapshot points. A layer hook that raises on rank 0 stops the pipeline at the next chunk: rank
0 sends stop instead of it, takes the results of the chunks already sent, and raises. The
stages' prefix sync (a reused prefix rank 0 loaded) is a broadcast of every layer's rows and
state. Prefill only: a pipelined instance does not decode. Thread-safe: one op at a time.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.cache import CacheManager, SequenceCache
from engine.model import HybridModel, LayerHook, _chunks
from engine.parallel.comm import GroupFailed, _collective
from engine.parallel.group import Channel
from engine.parallel.leader import _DeferredHook
from engine.parallel.ops import ALL_LOGITS, SYNC, Op, apply_copies, header

log = logging.getLogger(__name__)
TAG_STRIDE = 8
FINAL_TAG = 1 << 22
STOP, DATA = 0, 1


@dataclass(frozen=True)
class StageLayers:
    """What one stage computes: its layers and their indices among the MLA / KDA layers."""

    layers: range
    mla: tuple[int, ...]  # global MLA indices (the pool's layer axis)
    kda: tuple[int, ...]  # global KDA indices (the slots' layer axis)

    @classmethod
    def of(cls, model_cfg, layers: range) -> StageLayers:
        mla = tuple(model_cfg.mla_layer_ids.index(i) for i in layers if model_cfg.is_mla(i))
        kda = tuple(model_cfg.kda_layer_ids.index(i) for i in layers if not model_cfg.is_mla(i))
        return cls(layers, mla, kda)


@dataclass(frozen=True)
class PrefillPlan:
    """One pipelined prefill as every rank computes it from the op."""

    start: int
    end: int
    pipe_tokens: int  # tokens per pipeline chunk
    sub_tokens: int | None  # each stage's engine chunk inside a pipeline chunk (None: the model's)
    points: tuple[int, ...]  # snapshot points in (start, end]
    all_logits: bool

    def chunks(self) -> list[tuple[int, int]]:
        return _chunks(self.start, self.end, self.pipe_tokens, ())

    def points_in(self, lo: int, hi: int) -> list[int]:
        return [p for p in self.points if lo < p <= hi]


def _tag(k: int, kind: int) -> int:
    return k * TAG_STRIDE + kind


def _isend(t: torch.Tensor, dst: int, tag: int) -> dist.Work:
    return _collective(dist.isend, t.contiguous(), dst, tag=tag)


def _irecv(t: torch.Tensor, src: int, tag: int) -> dist.Work:
    return _collective(dist.irecv, t, src, tag=tag)


def _wait(work: dist.Work) -> None:
    _collective(work.wait)


def run_stage_chunk(model: HybridModel, cache: CacheManager, seq: SequenceCache, x: torch.Tensor, lo: int,
                    plan: PrefillPlan, prefixes, hook: LayerHook | None, snaps: dict[int, tuple]) -> torch.Tensor:
    """This stage's layers over pipeline chunk [lo, lo + len(x)) in engine sub-chunks cut at
    the snapshot points (``x``: token ids on the first stage, else hidden states); the state
    of the slot is kept in ``snaps`` at each point. Returns the chunk's hidden states."""
    hi = lo + x.shape[0]
    cuts = plan.points if model.cfg.cache_layout.has_state else ()
    outs = []
    for a, b in _chunks(lo, hi, plan.sub_tokens or model.prefill_chunk_tokens, cuts):
        part = x[a - lo : b - lo]
        h = model.embed_tokens(part) if part.dtype == torch.long else part
        outs.append(model.forward_layers(cache, seq, h, a, hook, prefixes))
        seq.num_tokens = b
        for p in plan.points_in(a, b):
            snaps[p] = (cache.slots.state[:, seq.slot].clone(), cache.slots.conv[:, seq.slot].clone())
    return torch.cat(outs)


class PipelineModel:
    """Rank 0 (stage 0) of a pipelined prefill instance, in the shape of ``HybridModel``'s
    prefill interface. ``stage``: rank 0's model (its layers, the embedding); ``stages``: every
    stage's layers, in order."""

    supports_decode = False
    pipelined = True

    def __init__(self, stage: HybridModel, channel: Channel, stages: Sequence[StageLayers],
                 on_failure: Callable[[str], None] | None = None):
        self.stage, self.channel, self.stages, self.on_failure = stage, channel, list(stages), on_failure
        self.cfg, self.fingerprint, self.device, self.dtype = stage.cfg, stage.fingerprint, stage.device, stage.dtype
        self.prefill_chunk_tokens = stage.prefill_chunk_tokens
        self.tokenizer = None
        self.plan = stage.plan
        self._lock = threading.RLock()
        self._caches: weakref.WeakKeyDictionary[CacheManager, int] = weakref.WeakKeyDictionary()
        self._next_cache_id = 1
        self._dropped: collections.deque[int] = collections.deque()
        self._current: dict[int, weakref.ref] = {}
        self.failed = ""

    # ---- ops (as GroupModel) -------------------------------------------------------------------
    def _send(self, op: Op, *args: int, ints: Sequence[int] = ()) -> None:
        if self.failed:
            raise GroupFailed(f"this instance lost a rank earlier: {self.failed}")
        try:
            while self._dropped:
                h = header(Op.DROP_CACHE, self._dropped.popleft())
                self.channel.ints(h, len(h))
            h = header(op, *args)
            self.channel.ints(h, len(h))
            self.channel.ints(list(ints), len(ints))
        except GroupFailed as e:
            self._fail(e)
            raise

    def _fail(self, e: GroupFailed) -> None:
        if not self.failed:
            self.failed = str(e)
            if self.on_failure is not None:
                self.on_failure(str(e))

    def close(self) -> None:
        with self._lock:
            if not self.failed:
                try:
                    self._send(Op.SHUTDOWN)
                except GroupFailed:
                    return
                self.failed = "closed"

    def new_cache(self, num_pages: int, num_slots: int, block_size: int) -> CacheManager:
        """A canonical cache of every layer (rank 0's); each later stage keeps its own."""
        with self._lock:
            cache = CacheManager(self.cfg, num_pages, num_slots, block_size, self.dtype, self.device)
            cache_id, self._next_cache_id = self._next_cache_id, self._next_cache_id + 1
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
            ref = self._current.get(id(seq))
            sync = start > 0 and (ref is None or ref() is not seq)
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
            key = id(seq)
            self._current[key] = weakref.ref(seq, lambda _, key=key: self._current.pop(key, None))
            return logits


def sync_stages(channel: Channel, cache: CacheManager, seq: SequenceCache, num_tokens: int, canonical: bool) -> None:
    """Collective: every layer's rows of tokens [0, num_tokens) and the request's whole KDA
    state, from rank 0's canonical cache into every stage's (a broadcast each)."""
    kv = cache.pool.kv
    if canonical:
        rows = torch.stack([cache.rows(seq, i, 0, num_tokens) for i in range(kv.shape[0])]).contiguous()
    else:
        rows = kv.new_empty((kv.shape[0], num_tokens, kv.shape[-1]))
    channel.tensor(rows)
    if not canonical:
        for i in range(kv.shape[0]):
            cache.write_rows(seq, i, 0, rows[i])
    if cache.cfg.kda_layer_ids:
        for t in (cache.slots.state, cache.slots.conv):
            part = t[:, seq.slot].contiguous()
            channel.tensor(part)
            t[:, seq.slot] = part


class _Leader:
    """Rank 0's side of one pipelined prefill (see the module docstring)."""

    def __init__(self, owner: PipelineModel, cache: CacheManager, seq: SequenceCache, plan: PrefillPlan,
                 on_layer: LayerHook | None):
        self.owner, self.cache, self.seq, self.plan = owner, cache, seq, plan
        self.model = owner.stage
        self.hook = _DeferredHook(on_layer)
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
            _wait(work)
        if stopped:
            raise self.hook.raised[0]
        last_logits = self._finals()
        if self.hook.raised:
            raise self.hook.raised[0]
        return torch.cat(self.logits) if plan.all_logits else last_logits

    def _send_to_next(self, k: int, flag: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        self._sends.append((_isend(flag, 1, _tag(k, 0)), flag))
        if hidden is not None:
            hidden = hidden.contiguous()
            self._sends.append((_isend(hidden, 1, _tag(k, 1)), hidden))

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
            out += [(s, name, buf, _irecv(buf, s, _tag(k, kind))) for name, buf, kind in bufs]
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
            _wait(work)
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
                _wait(_irecv(state, s, FINAL_TAG))
                _wait(_irecv(conv, s, FINAL_TAG + 1))
                slots.state[list(stage.kda), slot] = state
                slots.conv[list(stage.kda), slot] = conv
        logits = torch.empty(1, self.cfg_vocab, dtype=torch.float32)
        if not self.plan.all_logits:
            _wait(_irecv(logits, self.last, FINAL_TAG + 2))
        return logits


def follow_prefill(model: HybridModel, channel: Channel, stages: Sequence[StageLayers], caches: dict[int, CacheManager],
                   args: list[int]) -> None:
    """A later stage's side of one CPP_PREFILL op (``args``: the header after the op code)."""
    cache_id, slot, start, n_ids, n_pages, n_points, chunk_tokens, flags, n_copies, pipe = args[:10]
    ints = channel.ints(None, n_pages + n_ids + n_points + 2 * n_copies)
    points = tuple(ints[n_pages + n_ids : n_pages + n_ids + n_points])  # the token ids are rank 0's alone
    cache = caches[cache_id]
    apply_copies(cache, ints[n_pages + n_ids + n_points:])
    seq = SequenceCache("", ints[:n_pages], slot, num_tokens=start)
    if flags & SYNC:
        sync_stages(channel, cache, seq, start, canonical=False)
    elif start == 0:
        cache.slots.state[:, slot].zero_()
        cache.slots.conv[:, slot].zero_()
    plan = PrefillPlan(start, start + n_ids, pipe, chunk_tokens or None, points, bool(flags & ALL_LOGITS))
    _Stage(model, channel, stages, cache, seq, plan).run()


class _Stage:
    """A later stage's side of one pipelined prefill (see the module docstring)."""

    def __init__(self, model: HybridModel, channel: Channel, stages: Sequence[StageLayers], cache: CacheManager,
                 seq: SequenceCache, plan: PrefillPlan):
        self.model, self.cache, self.seq, self.plan = model, cache, seq, plan
        self.s = channel.rank
        self.stage, self.last = stages[self.s], self.s == len(stages) - 1
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.contiguous()
        self._sends.append((_isend(t, dst, tag), t))

    def run(self) -> None:
        prefixes = self.model.expanded_prefixes(self.cache, self.seq, self.plan.end)
        h = None
        for k, (lo, hi) in enumerate(self.plan.chunks()):
            h = self._chunk(k, lo, hi, prefixes)
            if h is None:
                break
        else:
            self._finals(h)
        for work, _ in self._sends:
            _wait(work)

    def _chunk(self, k: int, lo: int, hi: int, prefixes) -> torch.Tensor | None:
        """Chunk k from the stage before, through this stage's layers, its results to rank 0 and
        its hidden states on; None when rank 0 stopped the pipeline (the stop is passed on)."""
        s, stage, cache, seq = self.s, self.stage, self.cache, self.seq
        flag = torch.empty(1, dtype=torch.long)
        _wait(_irecv(flag, s - 1, _tag(k, 0)))
        if int(flag) == STOP:
            if not self.last:
                self._send(flag, s + 1, _tag(k, 0))
            return None
        x = torch.empty(hi - lo, self.model.cfg.hidden_size, dtype=self.model.dtype)
        _wait(_irecv(x, s - 1, _tag(k, 1)))
        snaps: dict[int, tuple] = {}
        h = run_stage_chunk(self.model, cache, seq, x, lo, self.plan, prefixes, None, snaps)
        if stage.mla:
            self._send(torch.stack([cache.rows(seq, i, lo, hi) for i in stage.mla]), 0, _tag(k, 2))
        if stage.kda and snaps:
            kda = list(stage.kda)
            self._send(torch.stack([snaps[p][0][kda] for p in sorted(snaps)]), 0, _tag(k, 4))
            self._send(torch.stack([snaps[p][1][kda] for p in sorted(snaps)]), 0, _tag(k, 5))
        if not self.last:
            self._send(flag, s + 1, _tag(k, 0))
            self._send(h, s + 1, _tag(k, 1))
        elif self.plan.all_logits:
            self._send(self.model.logits(h), 0, _tag(k, 3))
        return h

    def _finals(self, h: torch.Tensor | None) -> None:
        if self.stage.kda:
            kda = list(self.stage.kda)
            self._send(self.cache.slots.state[kda, self.seq.slot], 0, FINAL_TAG)
            self._send(self.cache.slots.conv[kda, self.seq.slot], 0, FINAL_TAG + 1)
        if self.last and not self.plan.all_logits and h is not None:
            self._send(self.model.logits(h[-1:]), 0, FINAL_TAG + 2)
