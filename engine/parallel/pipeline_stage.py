"""A later stage of a pipelined (CPP) prefill: its side of one prefill op, run by its
``Follower`` (``engine.parallel.pipeline`` has the layout). On rank 0's stop it passes the stop
on and returns; the results of chunks it already sent stay sent. Single-threaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from engine.cache import CacheManager, SequenceCache
from engine.model import HybridModel
from engine.parallel.group import Channel
from engine.parallel.ops import ALL_LOGITS, SYNC, apply_copies
from engine.parallel.pipeline import (
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
        self._sends.append((isend(t, dst, tag), t))

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
            wait(work)

    def _chunk(self, k: int, lo: int, hi: int, prefixes) -> torch.Tensor | None:
        """Chunk k from the stage before, through this stage's layers, its results to rank 0 and
        its hidden states on; None when rank 0 stopped the pipeline (the stop is passed on)."""
        s, stage, cache, seq = self.s, self.stage, self.cache, self.seq
        flag = torch.empty(1, dtype=torch.long)
        wait(irecv(flag, s - 1, tag(k, 0)))
        if int(flag) == STOP:
            if not self.last:
                self._send(flag, s + 1, tag(k, 0))
            return None
        x = torch.empty(hi - lo, self.model.cfg.hidden_size, dtype=self.model.dtype)
        wait(irecv(x, s - 1, tag(k, 1)))
        snaps: dict[int, tuple] = {}
        h = run_stage_chunk(self.model, cache, seq, x, lo, self.plan, prefixes, None, snaps)
        if stage.mla:
            self._send(torch.stack([cache.rows(seq, i, lo, hi) for i in stage.mla]), 0, tag(k, 2))
        if stage.kda and snaps:
            kda = list(stage.kda)
            self._send(torch.stack([snaps[p][0][kda] for p in sorted(snaps)]), 0, tag(k, 4))
            self._send(torch.stack([snaps[p][1][kda] for p in sorted(snaps)]), 0, tag(k, 5))
        if not self.last:
            self._send(flag, s + 1, tag(k, 0))
            self._send(h, s + 1, tag(k, 1))
        elif self.plan.all_logits:
            self._send(self.model.logits(h), 0, tag(k, 3))
        return h

    def _finals(self, h: torch.Tensor | None) -> None:
        if self.stage.kda:
            kda = list(self.stage.kda)
            self._send(self.cache.slots.state[kda, self.seq.slot], 0, FINAL_TAG)
            self._send(self.cache.slots.conv[kda, self.seq.slot], 0, FINAL_TAG + 1)
        if self.last and not self.plan.all_logits and h is not None:
            self._send(self.model.logits(h[-1:]), 0, FINAL_TAG + 2)
