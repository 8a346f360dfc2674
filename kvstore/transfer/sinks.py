"""Ready-made sinks: a decode worker's paged MLA pool plus KDA state tensors, and a blob
collector. They run on the receiver's I/O thread (see ``base.Sink``) and own no locks: the
destination pages of a request are not read until its transfer completes.

``PagePoolSink.views`` names where each chunk lands in host memory, so the tcp backend receives
a body straight into the pages (no staging copy) and verifies it there. ``placement`` describes
the destination for direct writes when the pool and the state tensors live in shareable memory
(``regions``); the shm backend then lets the sender write chunks straight into the pages and
verifies them there (one copy).

Token t of a request lives at page ``page_table[t // block_size]``, row ``t % block_size``::

    pool[mla_slot]      [num_pages, block_size, latent_dim]
    tokens  0 .. 15 | 16 .. 31 | 32 .. 47        (block_size 16)
    pages   page_table[0], page_table[1], page_table[2]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch

from kvstore.transfer.frames import Kind
from kvstore.transfer.placement import FlatPlacement, LocalPlacement, PagePlacement, Region, RowPlacement
from kvstore.transfer.regions import TensorRegion, region_of


class PagePoolSink:
    """Writes MLA rows into ``pool[mla_slot[layer]]`` through ``page_table`` and KDA state/conv
    tensors into ``kda_state[layer]`` / ``kda_conv[layer]`` (each preallocated by the caller)."""

    def __init__(
        self,
        pool: torch.Tensor,
        page_table: torch.Tensor,
        mla_slot: Mapping[int, int],
        kda_state: Mapping[int, torch.Tensor] | None = None,
        kda_conv: Mapping[int, torch.Tensor] | None = None,
    ):
        if pool.dim() != 4:
            raise ValueError(
                f"pool must be [num_mla_layers, num_pages, block_size, latent_dim], got {tuple(pool.shape)}"
            )
        self.pool = pool
        self.page_table = page_table.to(torch.int64)
        self.mla_slot = dict(mla_slot)
        self.kda_state = dict(kda_state or {})
        self.kda_conv = dict(kda_conv or {})
        self.block_size = pool.shape[2]
        item = pool.element_size()
        # Row byte ranges relative to the pool's first byte (region 0 = the pool itself).
        self._rows = RowPlacement(
            region=0,
            layer_offsets=tuple((layer, slot * pool.stride(0) * item) for layer, slot in sorted(self.mla_slot.items())),
            page_ids=tuple(self.page_table.tolist()),
            rows_per_page=self.block_size,
            row_bytes=pool.shape[3] * item,
            page_stride=pool.stride(1) * item,
        )
        self._pool_bytes = _bytes_of(pool) if pool.device.type == "cpu" and pool.is_contiguous() else None

    def write(self, kind: Kind, layer: int, token_start: int, token_end: int, tensor: torch.Tensor) -> None:
        if kind == Kind.MLA_ROWS:
            self._write_rows(layer, token_start, token_end, tensor)
        elif kind in (Kind.KDA_STATE, Kind.KDA_CONV):
            table = self.kda_state if kind == Kind.KDA_STATE else self.kda_conv
            if layer not in table:
                raise ValueError(f"no {kind.name} destination for layer {layer}")
            _copy(table[layer], tensor)
        else:
            raise ValueError(f"PagePoolSink takes no {kind.name}")

    def _write_rows(self, layer: int, token_start: int, token_end: int, rows: torch.Tensor) -> None:
        if layer not in self.mla_slot:
            raise ValueError(f"no pool slot for MLA layer {layer}")
        if token_end > self.page_table.numel() * self.block_size:
            raise ValueError(f"tokens up to {token_end} exceed the {self.page_table.numel()} pages reserved")
        if self._pool_bytes is None:  # a device pool: one scatter
            tokens = torch.arange(token_start, token_end)
            flat_rows = self.page_table[tokens // self.block_size] * self.block_size + tokens % self.block_size
            pool_layer = self.pool[self.mla_slot[layer]]
            pool_layer.view(-1, pool_layer.shape[-1]).index_copy_(0, flat_rows, rows.to(self.pool.device))
            return
        # Host pool: one numpy copy per run of adjacent pages (single-threaded, unlike torch's).
        source, position = _bytes_of(rows), 0
        for _, offset, nbytes in self._rows.segments(layer, token_start, token_end):
            np.copyto(self._pool_bytes[offset : offset + nbytes], source[position : position + nbytes])
            position += nbytes

    def views(self, kind: Kind, layer: int, token_start: int, token_end: int) -> list[np.ndarray] | None:
        """Writable byte views of where a chunk goes, in body order (``base.ViewSink``: a stream
        backend receives the body straight into them, then verifies it); None when that memory
        is not host memory (a device pool: ``write`` scatters it). ValueError for a chunk that
        has no destination here."""
        if kind == Kind.MLA_ROWS:
            if layer not in self.mla_slot:
                raise ValueError(f"no pool slot for MLA layer {layer}")
            if token_end > self.page_table.numel() * self.block_size:
                raise ValueError(f"tokens up to {token_end} exceed the {self.page_table.numel()} pages reserved")
            if self._pool_bytes is None:
                return None
            return [self._pool_bytes[o : o + n] for _, o, n in self._rows.segments(layer, token_start, token_end)]
        if kind in (Kind.KDA_STATE, Kind.KDA_CONV):
            table = self.kda_state if kind == Kind.KDA_STATE else self.kda_conv
            if layer not in table:
                raise ValueError(f"no {kind.name} destination for layer {layer}")
            tensor = table[layer]
            return [_bytes_of(tensor)] if tensor.device.type == "cpu" and tensor.is_contiguous() else None
        raise ValueError(f"PagePoolSink takes no {kind.name}")

    def placement(self) -> LocalPlacement | None:
        """Every destination as byte ranges of shared memory, or None if any of it is private
        memory (then chunks arrive through the backend's ring and ``write``). Computed once."""
        if not hasattr(self, "_placement"):
            self._placement = self._build_placement()
        return self._placement

    def _build_placement(self) -> LocalPlacement | None:
        regions = _RegionTable()
        pool = regions.add(self.pool)
        if pool is None:
            return None
        pool_region, pool_offset = pool
        rows = dataclasses.replace(
            self._rows,
            region=pool_region,
            layer_offsets=tuple((layer, pool_offset + offset) for layer, offset in self._rows.layer_offsets),
        )
        flats = []
        for kind, table in ((Kind.KDA_STATE, self.kda_state), (Kind.KDA_CONV, self.kda_conv)):
            for layer, tensor in sorted(table.items()):
                where = regions.add(tensor)
                if where is None:
                    return None
                flats.append(FlatPlacement(kind, layer, where[0], where[1], tensor.numel() * tensor.element_size()))
        return regions.local(PagePlacement(tuple(regions.regions), rows, tuple(flats)))

    def gather_rows(self, layer: int, token_start: int, token_end: int) -> torch.Tensor:
        """The rows of ``layer`` for [token_start, token_end) in token order (a copy; for checks)."""
        tokens = torch.arange(token_start, token_end)
        flat_rows = self.page_table[tokens // self.block_size] * self.block_size + tokens % self.block_size
        pool_layer = self.pool[self.mla_slot[layer]]
        return pool_layer.reshape(-1, pool_layer.shape[-1])[flat_rows]


class BlobSink:
    """Collects blobs (e.g. encoded cache blocks) as ``bytes`` by blob index."""

    def __init__(self) -> None:
        self.blobs: dict[int, bytes] = {}

    def write(self, kind: Kind, layer: int, token_start: int, token_end: int, tensor: torch.Tensor) -> None:
        if kind != Kind.BLOB:
            raise ValueError(f"BlobSink takes blobs only, got {kind.name}")
        self.blobs[layer] = tensor.numpy().tobytes()


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor (any dtype, bf16 included; no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _copy(destination: torch.Tensor, source: torch.Tensor) -> None:
    """``destination.copy_(source)``, through numpy on the host (one thread, no OpenMP fan-out)."""
    if destination.device.type == "cpu" and destination.is_contiguous() and source.is_contiguous():
        np.copyto(_bytes_of(destination), _bytes_of(source))
    else:
        destination.copy_(source)


class _RegionTable:
    """Deduplicates the regions of a placement: tensor -> (region index, byte offset)."""

    def __init__(self) -> None:
        self.regions: list[Region] = []
        self._views: list[memoryview] = []

    def add(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        found: TensorRegion | None = region_of(tensor)
        if found is None:
            return None
        if found.region not in self.regions:
            self.regions.append(found.region)
            self._views.append(found.view)
        return self.regions.index(found.region), found.offset

    def local(self, placement: PagePlacement) -> LocalPlacement:
        return LocalPlacement(placement, tuple(self._views))
