"""Per-request cache memory: MLA latent pages from a bounded pool and one KDA state slot.

Owns allocation and freeing only; it knows nothing of scheduling (the caller decides what to
do when ``try_*`` returns None). Pages are the unit the KV store moves.

Pages are reference-counted: a page may be held by several requests and by the KV store's
device tier at once (a cached prefix reused in place, ``try_reserve(shared_pages=...)``). A
shared page is read-only: writing into one first copies it to a fresh page of the writer's
own (copy-on-write, ``ensure_writable``), so the other holders never see the write.

Layout::

    PagePool.kv        [num_mla_layers, num_pages, block_size, latent_dim]
                        page p holds one block of one request for every MLA layer: kv[:, p]
    StateSlots.state   [num_kda_layers, num_slots, H, D, D]   fp32 recurrent state
    StateSlots.conv    [num_kda_layers, num_slots, K-1, 3*H*D] fp32 short-conv window

    token t of a request lives at kv[:, pages[t // block_size], t % block_size]

On CPU all three live in shareable memory (``engine.memory``), so a same-host transfer can write
received KV straight into a request's pages and state slot.

Not thread-safe, except ``PagePool``'s counts (the device tier frees pages from the store's
threads): one owner (the engine loop of a worker) calls the rest.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig
from engine.memory import shareable_zeros


class PagePool:
    """A bounded pool of fixed-size MLA pages, each with a count of its holders."""

    def __init__(self, num_layers: int, num_pages: int, block_size: int, latent_dim: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        if num_pages <= 0 or block_size <= 0:
            raise ValueError(f"num_pages={num_pages} and block_size={block_size} must be positive")
        self.block_size = block_size
        self.kv = shareable_zeros((num_layers, num_pages, block_size, latent_dim), dtype, device)
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs: dict[int, int] = {}  # page -> number of holders (requests, the device tier)
        self._lock = threading.Lock()

    @property
    def num_pages(self) -> int:
        return self.kv.shape[1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def page_bytes(self) -> int:
        return self.kv[:, 0].numel() * self.kv.element_size()

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def try_allocate(self, n: int) -> list[int] | None:
        """n page ids, each with one holder, or None (and nothing taken) when fewer than n are free."""
        with self._lock:
            if n > len(self._free):
                return None
            pages = [self._free.pop() for _ in range(n)]
            for p in pages:
                self._refs[p] = 1
            return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more holder for each (allocated) page."""
        pages = list(pages)
        with self._lock:
            missing = [p for p in pages if p not in self._refs]
            if missing:
                raise ValueError(f"pages {missing} shared but not allocated")
            for p in pages:
                self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """One holder fewer for each page; a page with none left goes back to the free list."""
        pages = list(pages)
        with self._lock:
            held = Counter(pages)
            over = [p for p, n in held.items() if self._refs.get(p, 0) < n]
            if over:
                raise ValueError(f"pages {over} freed but not allocated")
            for p in pages:
                self._refs[p] -= 1
                if not self._refs[p]:
                    del self._refs[p]
                    self._free.append(p)

    def check_integrity(self, holders: Iterable[int] | None = None) -> None:
        """Pages neither lost nor duplicated; with ``holders`` (every page each holder holds,
        repeated per holder), each page's count is exactly its holders."""
        with self._lock:
            assert len(self._free) + len(self._refs) == self.num_pages, "pages lost or duplicated"
            assert not self._refs.keys() & set(self._free), "a page is both free and used"
            assert all(n > 0 for n in self._refs.values()), "a used page without holders"
            if holders is not None:
                counted = Counter(holders)
                assert counted == Counter(self._refs), (
                    f"page holders disagree with the counts: {dict(counted)} != {self._refs}")


class StateSlots:
    """A bounded set of KDA state slots, one per running request."""

    def __init__(self, cfg: ModelConfig, num_slots: int, device: str):
        n_kda = len(cfg.kda_layer_ids)
        h, d = cfg.kda_num_heads, cfg.kda_head_dim
        self.state = shareable_zeros((n_kda, num_slots, h, d, d), torch.float32, device)
        self.conv = shareable_zeros((n_kda, num_slots, cfg.conv_window_len, cfg.conv_channels), torch.float32, device)
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def try_allocate(self) -> int | None:
        """A zeroed slot id, or None when all slots are taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        self.state[:, slot].zero_()
        self.conv[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} freed but not allocated")
        self._used.remove(slot)
        self._free.append(slot)

    def check_integrity(self) -> None:
        assert len(self._free) + len(self._used) == self.state.shape[1], "slots lost or duplicated"


@dataclass
class SequenceCache:
    """One request's cache: its pages (in token order), its KDA slot, and how many tokens it holds."""

    request_id: str
    pages: list[int]
    slot: int
    num_tokens: int = 0
    snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """KDA (state, conv) copies taken at token boundaries during prefill: position -> tensors."""


class CacheManager:
    """Hands out SequenceCaches from one page pool and one slot set."""

    def __init__(self, cfg: ModelConfig, num_pages: int, num_slots: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.cfg = cfg
        self.pool = PagePool(len(cfg.mla_layer_ids), num_pages, block_size, cfg.latent_dim, dtype, device)
        self.slots = StateSlots(cfg, num_slots, device)
        self.block_size = block_size
        self.live: dict[str, SequenceCache] = {}

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def try_reserve(self, request_id: str, num_tokens: int, shared_pages: Sequence[int] = ()) -> SequenceCache | None:
        """Reserves pages for num_tokens and a state slot, or returns None (nothing taken).

        ``shared_pages``: pages already holding the request's leading blocks (a cached prefix,
        read-only while shared); the request becomes one more holder of each and gets fresh
        pages for the rest. The caller sets ``num_tokens`` and the KDA slot for the prefix."""
        if request_id in self.live:
            raise ValueError(f"request {request_id!r} already holds a cache")
        need = self.pages_for(num_tokens) - len(shared_pages)
        if need < 0:
            raise ValueError(f"{len(shared_pages)} shared pages for {num_tokens} tokens")
        pages = self.pool.try_allocate(need)
        if pages is None:
            return None
        slot = self.slots.try_allocate()
        if slot is None:
            self.pool.free(pages)
            return None
        self.pool.share(shared_pages)
        seq = SequenceCache(request_id, [*shared_pages, *pages], slot)
        self.live[request_id] = seq
        return seq

    def try_extend(self, seq: SequenceCache, num_tokens: int) -> bool:
        """Grows seq's pages to hold num_tokens; False (nothing taken) when the pool is short."""
        need = self.pages_for(num_tokens) - len(seq.pages)
        if need <= 0:
            return True
        more = self.pool.try_allocate(need)
        if more is None:
            return False
        seq.pages.extend(more)
        return True

    def ensure_writable(self, seq: SequenceCache, page_index: int) -> None:
        """Copy-on-write: if seq's page ``page_index`` has other holders, seq gets a fresh
        copy of it (the others keep the original). MemoryError when no page is free."""
        page = seq.pages[page_index]
        if self.pool.refcount(page) <= 1:
            return
        fresh = self.pool.try_allocate(1)
        if fresh is None:
            raise MemoryError(f"request {seq.request_id}: no free page to copy shared page {page} before writing")
        self.pool.kv[:, fresh[0]] = self.pool.kv[:, page]
        seq.pages[page_index] = fresh[0]
        self.pool.free([page])

    def release(self, seq: SequenceCache) -> None:
        """Frees everything seq holds. Idempotent per request."""
        if self.live.pop(seq.request_id, None) is None:
            return
        self.pool.free(seq.pages)
        self.slots.free(seq.slot)
        seq.pages = []
        seq.snapshots.clear()

    def rows(self, seq: SequenceCache, mla_index: int, start: int, end: int) -> torch.Tensor:
        """Latent rows [end-start, L] of tokens [start, end) of one MLA layer (a copy if paged)."""
        if end <= start:
            return self.pool.kv.new_zeros(0, self.cfg.latent_dim)
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        idx = torch.tensor(seq.pages[first : last + 1], device=self.pool.kv.device)
        # index_select: on CPU about 2x faster than advanced indexing (kv[mla_index, idx]) here
        flat = self.pool.kv[mla_index].index_select(0, idx).reshape(-1, self.cfg.latent_dim)
        return flat[start - first * bs : end - first * bs]

    def write_rows(self, seq: SequenceCache, mla_index: int, start: int, rows: torch.Tensor) -> None:
        """Writes rows [n, L] for tokens [start, start+n) of one MLA layer into seq's pages."""
        bs, kv = self.block_size, self.pool.kv[mla_index]
        pos, n = start, rows.shape[0]
        for index in range(start // bs, -(-(start + n) // bs)):
            self.ensure_writable(seq, index)
        while pos < start + n:
            page, off = seq.pages[pos // bs], pos % bs
            take = min(bs - off, start + n - pos)
            kv[page, off : off + take] = rows[pos - start : pos - start + take]
            pos += take

    def check_integrity(self, other_holders: Iterable[int] = ()) -> None:
        """Every count right: each page's holders are exactly the live requests holding it plus
        ``other_holders`` (the pages a device tier holds, one entry per hold)."""
        self.slots.check_integrity()
        held = [p for s in self.live.values() for p in s.pages]
        for s in self.live.values():
            assert len(s.pages) == len(set(s.pages)), f"request {s.request_id} holds a page twice"
        self.pool.check_integrity([*held, *other_holders])
