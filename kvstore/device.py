"""Device tier: cached blocks kept in pages of the engine's own MLA page pool.

The prefill worker's pool (``engine.cache.PagePool``: GPU memory on CUDA, the bounded host
pool on CPU) holds the pages of running requests and, beside them, the pages of recently
used prefix blocks. This tier is one more holder of such pages (the pool counts holders)::

    pool.kv: [num_mla_layers, num_pages, block_size, latent_dim]
    a block in page p is kv[:, p]  ->  [num_mla_layers, block_size, latent_dim]

A block gets here in one of two ways:

- ``adopt``: a finished prefill hands over the page its block was computed in; nothing is
  copied. The request and the tier hold the page until the request releases it.
- ``put``: a block from elsewhere (a peer, a slower tier) is copied into a fresh page.

A later request reuses the block in place: it becomes one more holder of the page
(``CacheManager.try_reserve(shared_pages=...)``) and never writes into it (the engine copies a
shared page before writing: copy-on-write). Removing a block drops the tier's hold; the page
returns to the free list once no request holds it either. A block's KDA snapshot, if any, is
kept beside it as tensors on the pool's device; a reusing request copies it into its own
state slot. A block's size is its page bytes plus its snapshot bytes, counted against
``capacity_bytes``. Not thread-safe: used under the store's lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from kvstore.blocks import BlockKey, Tier
from kvstore.ledger import TierLedger
from kvstore.payload import BlockPayload

if TYPE_CHECKING:  # tensors only pass through here: a store without a device tier never loads torch
    import torch

Snapshot = tuple["torch.Tensor", "torch.Tensor"]  # KDA (state, conv) after the block's last token


class PoolView(Protocol):
    """What the device tier needs from the engine's page pool (``engine.cache.PagePool``)."""

    kv: torch.Tensor

    @property
    def num_free(self) -> int: ...

    def try_allocate(self, n: int) -> list[int] | None: ...

    def share(self, pages: Iterable[int]) -> None: ...

    def free(self, pages: Iterable[int]) -> None: ...


class DeviceTier:
    """Blocks held in pages of the engine's pool, at most ``capacity_bytes`` of them."""

    tier = Tier.DEVICE

    def __init__(
        self, pool: PoolView, capacity_bytes: int, model_fingerprint: str, mla_layer_ids: Sequence[int],
        kda_layer_ids: Sequence[int] = (),
    ) -> None:
        if len(mla_layer_ids) != pool.kv.shape[0]:
            raise ValueError(f"{len(mla_layer_ids)} MLA layer ids for a pool of {pool.kv.shape[0]} layers")
        self.ledger = TierLedger("device", capacity_bytes)
        self.model_fingerprint = model_fingerprint
        self.mla_layer_ids = tuple(mla_layer_ids)
        self.kda_layer_ids = tuple(kda_layer_ids)
        self.pool = pool
        self._page_of: dict[BlockKey, int] = {}
        self._snapshots: dict[BlockKey, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = {}

    @property
    def sizes_bytes(self) -> Mapping[BlockKey, int]:
        return self.ledger.sizes_bytes

    @property
    def page_bytes(self) -> int:
        page = self.pool.kv[:, 0]
        return page.numel() * page.element_size()

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    def size_for(self, payload: BlockPayload) -> int:
        """Bytes ``payload`` would take here: one page plus its snapshot tensors."""
        if payload.kda_state is None or payload.kda_conv is None:
            return self.page_bytes
        return self.snapshot_size((payload.kda_state, payload.kda_conv))

    def snapshot_size(self, snapshot: Snapshot | None) -> int:
        """Bytes of a block adopted with ``snapshot``: one page plus the snapshot tensors."""
        if snapshot is None:
            return self.page_bytes
        return self.page_bytes + sum(t.numel() * t.element_size() for t in snapshot)

    def page_of(self, key: BlockKey) -> int | None:
        """The page holding ``key``'s MLA rows; valid while the key stays in this tier."""
        return self._page_of.get(key)

    def snapshot_of(self, key: BlockKey) -> Snapshot | None:
        """The block's KDA (state, conv) on the pool's device (read-only: copy before use)."""
        entry = self._snapshots.get(key)
        return None if entry is None else (entry[0], entry[1])

    def held_pages(self) -> list[int]:
        """The pages this tier holds (one hold each), for the pool's integrity check."""
        return list(self._page_of.values())

    def check_payload(self, payload: BlockPayload) -> None:
        """ValueError when the block's MLA shape or layer ids do not match the pool's."""
        expected = tuple(self.pool.kv[:, 0].shape)
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
        self._check_room(key, size_bytes)
        pages = self.pool.try_allocate(1)
        if pages is None:
            return False
        self.pool.kv[:, pages[0]].copy_(payload.mla)
        snapshot = None
        if payload.kda_state is not None and payload.kda_conv is not None:
            snapshot = (payload.kda_state, payload.kda_conv)
        self._record(key, pages[0], snapshot, payload.kda_layer_ids, size_bytes)
        return True

    def adopt(self, key: BlockKey, page: int, snapshot: Snapshot | None) -> None:
        """Hold ``page`` (already holding the block's rows, computed by a request) as block
        ``key``, with its KDA snapshot if it has one; nothing is copied but the snapshot.
        ValueError when the key is present or it passes the capacity."""
        size_bytes = self.snapshot_size(snapshot)
        self._check_room(key, size_bytes)
        self.pool.share([page])
        self._record(key, page, snapshot, self.kda_layer_ids if snapshot is not None else (), size_bytes)

    def try_get(self, key: BlockKey) -> BlockPayload | None:
        """A host copy of the block, or None when absent."""
        page_id = self._page_of.get(key)
        if page_id is None:
            return None
        mla = self.pool.kv[:, page_id].to("cpu", copy=True)
        state = conv = None
        kda_layer_ids: tuple[int, ...] = ()
        if key in self._snapshots:
            state_d, conv_d, kda_layer_ids = self._snapshots[key]
            state, conv = state_d.to("cpu", copy=True), conv_d.to("cpu", copy=True)
        return BlockPayload(self.model_fingerprint, mla, self.mla_layer_ids, state, conv, kda_layer_ids)

    def remove(self, key: BlockKey) -> int:
        """Drop a block and its hold on the page; returns the bytes freed (0 when absent)."""
        page_id = self._page_of.pop(key, None)
        if page_id is None:
            return 0
        self.pool.free([page_id])
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

    def _check_room(self, key: BlockKey, size_bytes: int) -> None:
        if key in self.ledger or not self.ledger.fits(size_bytes):
            raise ValueError(f"device: cannot add {key.hex()} ({size_bytes} bytes, {self.ledger.free_bytes} free)")

    def _record(self, key: BlockKey, page: int, snapshot: Snapshot | None, kda_layer_ids: tuple[int, ...],
                size_bytes: int) -> None:
        device = self.pool.kv.device
        self._page_of[key] = page
        if snapshot is not None:
            state, conv = snapshot
            self._snapshots[key] = (state.to(device, copy=True), conv.to(device, copy=True), kda_layer_ids)
        self.ledger.add(key, size_bytes, snapshot is not None)
