"""A rank other than 0: follows rank 0's schedule until it says stop or the group fails.

Owns ``Follower``, the loop of every non-zero rank of a parallel instance. It keeps its shard
caches by rank 0's cache ids and, for each op (``engine.parallel.ops``), builds the request
views rank 0 describes (pages, slot, tokens held) and computes its share of the same forward
pass, meeting rank 0 at every collective. It holds no allocator: rank 0 decides every page and
slot, so a follower only writes where it is told. Single-threaded.
"""

from __future__ import annotations

import logging

from engine.cache import CacheManager, SequenceCache
from engine.model import HybridModel
from engine.parallel.group import Channel
from engine.parallel.ops import (
    ALL_LOGITS,
    HEADER_LEN,
    SYNC,
    Op,
    PrefillAborted,
    apply_copies,
    gather_state,
    sync_prefix,
)
from engine.parallel.pipeline import StageLayers
from engine.parallel.pipeline_stage import follow_prefill

log = logging.getLogger(__name__)


class Follower:
    def __init__(self, shard: HybridModel, channel: Channel):
        assert not channel.is_leader
        self.shard, self.channel = shard, channel
        shape = shard.plan.shape
        self.tp = shape.tp
        self._t_of = [shape.coords(r)[2] for r in range(shape.world_size)]
        self.caches: dict[int, CacheManager] = {}
        self.num_ops = 0
        self.stages = [StageLayers.of(shard.cfg, shape.stage_layers(shard.cfg.num_hidden_layers, s))
                       for s in range(shape.stages)]

    def run(self) -> None:
        """Serves ops until SHUTDOWN; ``GroupFailed`` when rank 0 (or another rank) is gone."""
        handlers = {Op.NOOP: lambda args: None, Op.NEW_CACHE: self._new_cache, Op.DROP_CACHE: self._drop_cache,
                    Op.PREFILL: self._prefill, Op.DECODE: self._decode,
                    Op.CPP_PREFILL: lambda args: follow_prefill(self.shard, self.channel, self.stages, self.caches,
                                                                args)}
        while True:
            h = self.channel.ints(None, HEADER_LEN)
            op, args = Op(h[0]), h[1:]
            if op is Op.SHUTDOWN:
                log.info("rank %d: shutdown after %d ops", self.channel.rank, self.num_ops)
                return
            handlers[op](args)
            self.num_ops += 1

    def _new_cache(self, args: list[int]) -> None:
        cache_id, num_pages, num_slots, block_size = args[:4]
        self.caches[cache_id] = self.shard.new_cache(num_pages, num_slots, block_size)

    def _drop_cache(self, args: list[int]) -> None:
        self.caches.pop(args[0], None)

    def _prefill(self, args: list[int]) -> None:
        cache_id, slot, start, n_ids, n_pages, n_points, chunk_tokens, flags, n_copies = args[:9]
        ints = self.channel.ints(None, n_pages + n_ids + n_points + 2 * n_copies)
        pages, ids = ints[:n_pages], ints[n_pages : n_pages + n_ids]
        points = ints[n_pages + n_ids : n_pages + n_ids + n_points]
        cache = self.caches[cache_id]
        apply_copies(cache, ints[n_pages + n_ids + n_points:])
        seq = SequenceCache("", pages, slot, num_tokens=start)
        if flags & SYNC:
            sync_prefix(self.channel, self.tp, self._t_of, cache, seq, start, None)
        elif start == 0:
            cache.slots.state[:, slot].zero_()
            cache.slots.conv[:, slot].zero_()

        def chunk_done(lo: int, hi: int) -> None:
            if self.channel.ints(None, 1)[0]:
                raise PrefillAborted
            for _ in (p for p in points if lo < p <= hi):
                gather_state(self.channel, self.tp, cache, slot)

        try:
            self.shard.prefill(cache, seq, ids, all_logits=bool(flags & ALL_LOGITS), chunk_tokens=chunk_tokens or None,
                               snapshot_at=points, on_chunk=chunk_done)
        except PrefillAborted:
            return
        gather_state(self.channel, self.tp, cache, slot)

    def _decode(self, args: list[int]) -> None:
        cache_id, batch, n_ints, n_copies = args[:4]
        ints = self.channel.ints(None, n_ints + 2 * n_copies)
        cache = self.caches[cache_id]
        apply_copies(cache, ints[n_ints:])
        seqs, tokens, syncs, i = [], [], [], 0
        for _ in range(batch):
            slot, num_tokens, token, sync, n_pages = ints[i : i + 5]
            seqs.append(SequenceCache("", ints[i + 5 : i + 5 + n_pages], slot, num_tokens=num_tokens))
            tokens.append(token)
            syncs.append(sync)
            i += 5 + n_pages
        for seq, sync in zip(seqs, syncs, strict=True):
            if sync:
                sync_prefix(self.channel, self.tp, self._t_of, cache, seq, seq.num_tokens, None)
        self.shard.decode_step(cache, seqs, tokens)
