"""Device tier: cached blocks kept in the engine's own MLA page pool.

A thin adapter. The caller (the engine) owns the pool tensor and its page allocator; this
tier borrows one page per cached block and returns it on removal::

    pages: [num_mla_layers, num_pages, block_size, latent_dim]
    a block in page p is pages[:, p]  ->  [num_mla_layers, block_size, latent_dim]

A block's KDA snapshot, if any, is kept beside it as tensors on the pool's device. A block's
size is its page bytes plus its snapshot bytes, counted against ``capacity_bytes``; a put
also fails when the allocator has no page. Not thread-safe: used under the store's lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from kvstore.blocks import BlockKey, Tier
from kvstore.ledger import TierLedger
from kvstore.payload import BlockPayload


class PagePool(Protocol):
    """What the device tier needs from the engine's page pool."""

    @property
    def pages(self) -> torch.Tensor: ...

    def allocate_page(self) -> int | None: ...

    def free_page(self, page_id: int) -> None: ...


class SimplePagePool:
    """A page pool with a free list, for CPU runs and tests."""

    def __init__(self, pages: torch.Tensor) -> None:
        if pages.dim() != 4:
            raise ValueError(f"pages must be [layers, num_pages, block_size, latent_dim], got {tuple(pages.shape)}")
        self._pages = pages
        self._free = list(range(pages.shape[1] - 1, -1, -1))  # pop() hands out page 0 first

    @property
    def pages(self) -> torch.Tensor:
        return self._pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def allocate_page(self) -> int | None:
        return self._free.pop() if self._free else None

    def free_page(self, page_id: int) -> None:
        if not 0 <= page_id < self._pages.shape[1] or page_id in self._free:
            raise ValueError(f"page {page_id} is not allocated")
        self._free.append(page_id)


class DeviceTier:
    """Blocks held in pages of a caller's pool, at most ``capacity_bytes`` of them."""

    tier = Tier.DEVICE

    def __init__(
        self, pool: PagePool, capacity_bytes: int, model_fingerprint: str, mla_layer_ids: Sequence[int]
    ) -> None:
        if len(mla_layer_ids) != pool.pages.shape[0]:
            raise ValueError(f"{len(mla_layer_ids)} MLA layer ids for a pool of {pool.pages.shape[0]} layers")
        self.ledger = TierLedger("device", capacity_bytes)
        self.model_fingerprint = model_fingerprint
        self.mla_layer_ids = tuple(mla_layer_ids)
        self._pool = pool
        self._page_of: dict[BlockKey, int] = {}
        self._snapshots: dict[BlockKey, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = {}

    @property
    def sizes_bytes(self) -> Mapping[BlockKey, int]:
        return self.ledger.sizes_bytes

    @property
    def page_bytes(self) -> int:
        page = self._pool.pages[:, 0]
        return page.numel() * page.element_size()

    def size_for(self, payload: BlockPayload) -> int:
        """Bytes ``payload`` would take here: one page plus its snapshot tensors."""
        snapshot_bytes = 0
        if payload.kda_state is not None and payload.kda_conv is not None:
            snapshot_bytes = sum(t.numel() * t.element_size() for t in (payload.kda_state, payload.kda_conv))
        return self.page_bytes + snapshot_bytes

    def page_of(self, key: BlockKey) -> int | None:
        """The page holding ``key``'s MLA rows; valid while the key stays in this tier."""
        return self._page_of.get(key)

    def check_payload(self, payload: BlockPayload) -> None:
        """ValueError when the block's MLA shape or layer ids do not match the pool's."""
        expected = tuple(self._pool.pages[:, 0].shape)
        if tuple(payload.mla.shape) != expected or payload.mla_layer_ids != self.mla_layer_ids:
            raise ValueError(
                f"block {tuple(payload.mla.shape)} layers {payload.mla_layer_ids} does not match the pool's "
                f"{expected} layers {self.mla_layer_ids}"
            )

    def put(self, key: BlockKey, payload: BlockPayload) -> bool:
        """Copy a block into a fresh page. ValueError when it does not match the pool
        (``check_payload``), the key is present, or it passes the capacity; False when no
        page is free."""
        self.check_payload(payload)
        size_bytes = self.size_for(payload)
        if key in self.ledger or not self.ledger.fits(size_bytes):
            raise ValueError(f"device: cannot add {key.hex()} ({size_bytes} bytes, {self.ledger.free_bytes} free)")
        page_id = self._pool.allocate_page()
        if page_id is None:
            return False
        device = self._pool.pages.device
        self._pool.pages[:, page_id].copy_(payload.mla)
        self._page_of[key] = page_id
        if payload.kda_state is not None and payload.kda_conv is not None:
            self._snapshots[key] = (
                payload.kda_state.to(device, copy=True),
                payload.kda_conv.to(device, copy=True),
                payload.kda_layer_ids,
            )
        self.ledger.add(key, size_bytes, payload.has_snapshot)
        return True

    def try_get(self, key: BlockKey) -> BlockPayload | None:
        """A host copy of the block, or None when absent."""
        page_id = self._page_of.get(key)
        if page_id is None:
            return None
        mla = self._pool.pages[:, page_id].to("cpu", copy=True)
        state = conv = None
        kda_layer_ids: tuple[int, ...] = ()
        if key in self._snapshots:
            state_d, conv_d, kda_layer_ids = self._snapshots[key]
            state, conv = state_d.to("cpu", copy=True), conv_d.to("cpu", copy=True)
        return BlockPayload(self.model_fingerprint, mla, self.mla_layer_ids, state, conv, kda_layer_ids)

    def remove(self, key: BlockKey) -> int:
        """Drop a block and give its page back; returns the bytes freed (0 when absent)."""
        page_id = self._page_of.pop(key, None)
        if page_id is None:
            return 0
        self._pool.free_page(page_id)
        self._snapshots.pop(key, None)
        return self.ledger.discard(key)

    def check_integrity(self) -> None:
        self.ledger.check_integrity()
        if self._page_of.keys() != self.ledger.sizes_bytes.keys():
            raise AssertionError("device: pages and ledger disagree on keys")
        if len(set(self._page_of.values())) != len(self._page_of):
            raise AssertionError("device: two blocks share a page")
        if not self._snapshots.keys() <= self._page_of.keys():
            raise AssertionError("device: a snapshot without its block")
