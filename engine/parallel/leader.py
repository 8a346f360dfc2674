"""Rank 0 of a parallel instance: the model the worker sees, driving every rank in lockstep.

Owns ``GroupModel``, which has the interface of ``engine.model.HybridModel`` that the workers,
``engine.generate`` and the warm-up use (``new_cache``, ``prefill``, ``decode_step``, ``cfg``,
``fingerprint``, ...). Each call becomes one op (``engine.parallel.ops``) that rank 0 sends and
then computes its own share of, as every other rank does (``engine.parallel.follower``).

The caches it hands out are **canonical**: the same layout as a single-rank engine's (every
KDA head's state; the MLA latent, which is the same on every rank), so the prefill worker's
store, the transfer engine and the decode sink work on them unchanged. Behind each one rank
0 keeps its shard cache (its KDA heads; the MLA pages *are* the canonical pool's). The two
meet at the seams:

- a request whose cache rank 0 filled (a reused prefix, KV received from a prefill worker of
  any shape) is synced to every rank before its first op: its rows broadcast, its state cut
  by head and scattered;
- a prefill gathers the KDA state into the canonical slot at each snapshot point (so stored
  blocks carry every head) and at its end (so the state pushed to decode does too);
- decode steps leave the canonical KDA state behind (the ranks hold it by head): a decode
  cache is never exported.

A layer hook that raises on rank 0 (the client left, a push failed) stops the prefill at the
end of the chunk on every rank (one flag per chunk); the exception is then raised here. A
failed collective (a rank died) raises ``GroupFailed`` and calls ``on_failure`` once: the
worker takes the instance out of the cluster and ends it (``engine.parallel.face``).
Thread-safe: one op at a time.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence

import torch

from engine.cache import CacheManager, SequenceCache
from engine.model import HybridModel, LayerHook
from engine.parallel.comm import GroupFailed
from engine.parallel.face import Face
from engine.parallel.group import Channel
from engine.parallel.ops import ALL_LOGITS, SYNC, Op, PrefillAborted, apply_copies, gather_state, sync_prefix

log = logging.getLogger(__name__)


class GroupModel(Face):
    """``shard``: rank 0's own share of the model; ``channel``: its world. ``tokenizer`` is
    set by the loader, as on ``HybridModel``."""

    def __init__(self, shard: HybridModel, channel: Channel, on_failure: Callable[[str], None] | None = None,
                 keepalive_s: float = 0.0):
        super().__init__(channel, on_failure, keepalive_s)
        self.shard = shard
        self.cfg, self.fingerprint, self.device, self.dtype = shard.cfg, shard.fingerprint, shard.device, shard.dtype
        self.prefill_chunk_tokens = shard.prefill_chunk_tokens
        self.tokenizer = None
        shape = shard.plan.shape
        self.tp = shape.tp
        self._t_of = [shape.coords(r)[2] for r in range(shape.world_size)]
        self._caches: weakref.WeakKeyDictionary[CacheManager, tuple[int, CacheManager]] = weakref.WeakKeyDictionary()

    @property
    def plan(self):
        return self.shard.plan

    # ---- caches -------------------------------------------------------------------------------
    def new_cache(self, num_pages: int, num_slots: int, block_size: int) -> CacheManager:
        """A canonical cache (every head's KDA state), with its shard on every rank."""
        with self._lock:
            cache = CacheManager(self.cfg, num_pages, num_slots, block_size, self.dtype, self.device)
            cache_id = self._new_cache_id()
            self._send(Op.NEW_CACHE, cache_id, num_pages, num_slots, block_size)
            shard = self.shard.new_cache(1, num_slots, block_size)
            shard.pool = cache.pool  # one MLA pool: rank 0 computes its rows straight into the canonical pages
            self._caches[cache] = (cache_id, shard)
            weakref.finalize(cache, self._dropped.append, cache_id)
            return cache

    def _shard_of(self, cache: CacheManager) -> tuple[int, CacheManager]:
        try:
            return self._caches[cache]
        except KeyError:
            raise ValueError("this cache was not made by this instance's new_cache") from None

    @staticmethod
    def _writable(cache: CacheManager, seq: SequenceCache, pages: range) -> list[int]:
        """Copy-on-write of the pages the op writes, done here before the op so every rank
        repeats the same copies; returns them flattened (src, dst)."""
        copies = []
        for i in pages:
            before = seq.pages[i]
            cache.ensure_writable(seq, i)
            if seq.pages[i] != before:
                copies += [before, seq.pages[i]]
        return copies

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(self, cache: CacheManager, seq: SequenceCache, token_ids: Sequence[int], *,
                all_logits: bool = False, chunk_tokens: int | None = None, snapshot_at: Sequence[int] = (),
                on_layer: LayerHook | None = None, on_chunk: Callable[[int, int], None] | None = None,
                ) -> torch.Tensor:
        """``HybridModel.prefill`` over every rank; the snapshots kept in ``seq.snapshots`` and
        the final KDA state in the canonical slot hold every head."""
        with self._lock:
            cache_id, shard = self._shard_of(cache)
            bs, start, n = cache.block_size, seq.num_tokens, len(token_ids)
            end = start + n
            if end > len(seq.pages) * bs:
                raise ValueError(f"request {seq.request_id}: {end} tokens need more than its {len(seq.pages)} pages")
            copies = self._writable(cache, seq, range(start // bs, -(-end // bs)))
            sync = start > 0 and not self._is_current(seq)
            points = sorted({int(p) for p in snapshot_at if start < p <= end})
            flags = (ALL_LOGITS if all_logits else 0) | (SYNC if sync else 0)
            self._send(Op.PREFILL, cache_id, seq.slot, start, n, len(seq.pages), len(points), chunk_tokens or 0,
                       flags, len(copies) // 2, ints=[*seq.pages, *map(int, token_ids), *points, *copies])
            try:
                return self._prefill(cache, shard, seq, token_ids, all_logits, chunk_tokens, points, sync,
                                     on_layer, on_chunk)
            except GroupFailed as e:
                self._fail(e)
                raise

    def _prefill(self, cache: CacheManager, shard: CacheManager, seq: SequenceCache, token_ids: Sequence[int],
                 all_logits: bool, chunk_tokens: int | None, points: list[int], sync: bool,
                 on_layer: LayerHook | None, on_chunk: Callable[[int, int], None] | None) -> torch.Tensor:
        if sync:
            sync_prefix(self.channel, self.tp, self._t_of, shard, seq, seq.num_tokens, cache)
        elif seq.num_tokens == 0:  # a fresh request starts from the zero state on every rank
            shard.slots.state[:, seq.slot].zero_()
            shard.slots.conv[:, seq.slot].zero_()
        hook = DeferredHook(on_layer)

        def chunk_done(lo: int, hi: int) -> None:
            self.channel.ints([1 if hook.raised else 0], 1)
            if hook.raised:
                raise PrefillAborted
            for point in (p for p in points if lo < p <= hi):
                gathered = gather_state(self.channel, self.tp, shard, seq.slot)
                if gathered is not None:
                    seq.snapshots[point] = gathered
            if on_chunk is not None:
                on_chunk(lo, hi)

        try:
            logits = self.shard.prefill(shard, seq, token_ids, all_logits=all_logits, chunk_tokens=chunk_tokens,
                                        snapshot_at=points, on_layer=hook, on_chunk=chunk_done)
        except PrefillAborted:
            raise hook.raised[0] from None
        final = gather_state(self.channel, self.tp, shard, seq.slot)
        if final is not None:
            cache.slots.state[:, seq.slot] = final[0]
            cache.slots.conv[:, seq.slot] = final[1]
        self._mark_current(seq)
        return logits

    # ---- decode -------------------------------------------------------------------------------
    def decode_step(self, cache: CacheManager, seqs: Sequence[SequenceCache], token_ids: Sequence[int]) -> torch.Tensor:
        """``HybridModel.decode_step`` over every rank: logits [B, vocab]."""
        with self._lock:
            cache_id, shard = self._shard_of(cache)
            bs = cache.block_size
            for s in seqs:
                if s.num_tokens >= len(s.pages) * bs:
                    raise ValueError(f"request {s.request_id}: no page for position {s.num_tokens}; extend first")
            copies: list[int] = []
            ints: list[int] = []
            syncs = [not self._is_current(s) for s in seqs]
            for s, tok, sync in zip(seqs, token_ids, syncs, strict=True):
                copies += self._writable(cache, s, range(s.num_tokens // bs, s.num_tokens // bs + 1))
                ints += [s.slot, s.num_tokens, int(tok), int(sync), len(s.pages), *s.pages]
            self._send(Op.DECODE, cache_id, len(seqs), len(ints), len(copies) // 2, ints=[*ints, *copies])
            try:
                for s, sync in zip(seqs, syncs, strict=True):
                    if sync:
                        sync_prefix(self.channel, self.tp, self._t_of, shard, s, s.num_tokens, cache)
                logits = self.shard.decode_step(shard, seqs, token_ids)
            except GroupFailed as e:
                self._fail(e)
                raise
            for s in seqs:
                self._mark_current(s)
            return logits


class DeferredHook:
    """Rank 0's layer hook: its first exception is kept (and no later layer is reported) until
    the chunk's end, where every rank stops together; raising mid-chunk would leave the other
    ranks waiting in the next collective."""

    def __init__(self, hook: LayerHook | None):
        self.hook = hook
        self.raised: list[BaseException] = []

    def __call__(self, layer: int, lo: int, hi: int) -> None:
        if self.hook is not None and not self.raised:
            try:
                self.hook(layer, lo, hi)
            except BaseException as e:  # noqa: BLE001 - raised at the chunk's end, on every rank
                self.raised.append(e)


__all__ = ["GroupModel", "apply_copies"]
