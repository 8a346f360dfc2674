"""Ready-made sinks: a decode worker's paged MLA pool plus KDA state tensors, and a blob
collector. They run on the receiver's I/O thread (see ``base.Sink``) and own no locks: the
destination pages of a request are not read until its transfer completes.

Token t of a request lives at page ``page_table[t // block_size]``, row ``t % block_size``::

    pool[mla_slot]      [num_pages, block_size, latent_dim]
    tokens  0 .. 15 | 16 .. 31 | 32 .. 47        (block_size 16)
    pages   page_table[0], page_table[1], page_table[2]
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvstore.transfer.frames import Kind


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

    def write(self, kind: Kind, layer: int, token_start: int, token_end: int, tensor: torch.Tensor) -> None:
        if kind == Kind.MLA_ROWS:
            self._write_rows(layer, token_start, token_end, tensor)
        elif kind in (Kind.KDA_STATE, Kind.KDA_CONV):
            table = self.kda_state if kind == Kind.KDA_STATE else self.kda_conv
            if layer not in table:
                raise ValueError(f"no {kind.name} destination for layer {layer}")
            table[layer].copy_(tensor)
        else:
            raise ValueError(f"PagePoolSink takes no {kind.name}")

    def _write_rows(self, layer: int, token_start: int, token_end: int, rows: torch.Tensor) -> None:
        if layer not in self.mla_slot:
            raise ValueError(f"no pool slot for MLA layer {layer}")
        if token_end > self.page_table.numel() * self.block_size:
            raise ValueError(f"tokens up to {token_end} exceed the {self.page_table.numel()} pages reserved")
        tokens = torch.arange(token_start, token_end)
        flat_rows = self.page_table[tokens // self.block_size] * self.block_size + tokens % self.block_size
        pool_layer = self.pool[self.mla_slot[layer]]
        pool_layer.view(-1, pool_layer.shape[-1]).index_copy_(0, flat_rows, rows)

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
