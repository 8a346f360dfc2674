"""Chunked pipeline parallelism (CPP, Mooncake FAST'25 §5.1): one prefill instance whose ranks
each compute a contiguous range of layers (a stage), a long prompt flowing through them in
chunks so that stage 1 works on chunk k while stage 0 works on chunk k+1::

    stage 0 (rank 0)   | chunk 0 | chunk 1 | chunk 2 | chunk 3 |
    stage 1 (rank 1)             | chunk 0 | chunk 1 | chunk 2 | chunk 3 |
                                 ^ hidden states of chunk 0 [T, hidden], point to point

Owns what both sides share: each stage's layers (``StageLayers``), one prefill's plan as every
rank computes it (``PrefillPlan``), the message tags, a stage's compute of one chunk
(``run_stage_chunk``) and the prefix sync. Rank 0's side is ``engine.parallel.pipeline_leader``
(``PipelineModel``), a later stage's ``engine.parallel.pipeline_stage``. Rank 0 holds the
canonical cache of every layer: each later stage sends back, per chunk, its MLA layers' rows
(rank 0 writes them into the request's pages and fires the layer hook, so the worker pushes
them to the decode worker layer by layer as today and keeps whole blocks in its store), its KDA
layers' state at each snapshot point inside the chunk, and at the end its final state; the
last stage sends the logits. Every message goes by its own tag::

    chunk k, stage s-1 -> s     tag 8k: flag (1 data, 0 stop)   tag 8k+1: hidden [T, hidden]
    chunk k, stage s  -> 0      tag 8k+2: rows [n_mla(s), T, latent]   tag 8k+3: logits [T, vocab]
                                tag 8k+4 / 8k+5: KDA state / conv at the chunk's snapshot points
    end,     stage s  -> 0      FINAL+0 / +1: final KDA state / conv   FINAL+2: last logits

Within a chunk each stage computes in the engine's own sub-chunks, cut at the snapshot points.
The stages' prefix sync (a reused prefix rank 0 loaded) is a broadcast of every layer's rows
and state. Prefill only: a pipelined instance does not decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.cache import CacheManager, SequenceCache
from engine.model import HybridModel, LayerHook, chunk_ranges
from engine.parallel.comm import collective
from engine.parallel.group import Channel

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
        return chunk_ranges(self.start, self.end, self.pipe_tokens, ())

    def points_in(self, lo: int, hi: int) -> list[int]:
        return [p for p in self.points if lo < p <= hi]


def tag(k: int, kind: int) -> int:
    return k * TAG_STRIDE + kind


def isend(t: torch.Tensor, dst: int, tag: int) -> dist.Work:
    return collective(dist.isend, t.contiguous(), dst, tag=tag)


def irecv(t: torch.Tensor, src: int, tag: int) -> dist.Work:
    return collective(dist.irecv, t, src, tag=tag)


def wait(work: dist.Work) -> None:
    collective(work.wait)


def run_stage_chunk(model: HybridModel, cache: CacheManager, seq: SequenceCache, x: torch.Tensor, lo: int,
                    plan: PrefillPlan, prefixes, hook: LayerHook | None, snaps: dict[int, tuple]) -> torch.Tensor:
    """This stage's layers over pipeline chunk [lo, lo + len(x)) in engine sub-chunks cut at
    the snapshot points (``x``: token ids on the first stage, else hidden states); the state
    of the slot is kept in ``snaps`` at each point. Returns the chunk's hidden states."""
    hi = lo + x.shape[0]
    cuts = plan.points if model.cfg.cache_layout.has_state else ()
    outs = []
    for a, b in chunk_ranges(lo, hi, plan.sub_tokens or model.prefill_chunk_tokens, cuts):
        part = x[a - lo : b - lo]
        h = model.embed_tokens(part) if part.dtype == torch.long else part
        outs.append(model.forward_layers(cache, seq, h, a, hook, prefixes))
        seq.num_tokens = b
        for p in plan.points_in(a, b):
            snaps[p] = (cache.slots.state[:, seq.slot].clone(), cache.slots.conv[:, seq.slot].clone())
    return torch.cat(outs)


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


