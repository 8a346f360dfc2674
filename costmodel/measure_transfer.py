"""Timing the real transfer engine and the real store tiers for a pull of k cached blocks.

A pull (what ``prefill_worker`` does when the Conductor plans a remote prefix) is measured in
two parts, whose sum is ``CostModels.transfer_s``:

- **read** (``time_read_s``): the holder reads the k blocks' encoded bytes from one tier of a
  real ``TieredStore`` (pinned, like ``PushBlocks``). DRAM returns the stored bytes; SSD reads
  and verifies files, with the page cache dropped first (``posix_fadvise``) so the disk is
  timed, not memory.
- **link** (``time_link_s``): the holder sends them as BLOB frames over one backend to a
  ``Receiver`` in this process, the puller waits for completion, decodes and verifies each
  payload and keeps it in its own DRAM store (``PrefillRunner._pull``). Not timed: the gRPC
  request that starts a pull (one round trip).

Sizes are tensor bytes (``BlockPayload.nbytes``: MLA rows + KDA snapshots), the unit
``CostModels.pull_bytes`` counts; frame and payload headers are part of the fitted cost.
Each k gets its own blocks, with KDA snapshots where a worker takes them (every interval
and the last block, where a planned reuse ends).
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from costmodel.measure_engine import synthetic_block
from engine import HybridModel
from kvstore.blocks import BlockKey, Tier, chain_keys
from kvstore.hitrule import SnapshotPolicy
from kvstore.payload_format import decode
from kvstore.ssd import BLOCK_SUFFIX
from kvstore.store import StoreConfig, TieredStore
from kvstore.transfer import BlobSink, Expected, Kind, Receiver, TransferConfig, connect

_STORE_BYTES = 16 << 30  # a ledger bound, not an allocation


class TransferBench:
    """Holder stores (DRAM and SSD, same blocks), a receiver listening on every backend with one
    connected sender each, and the puller's DRAM store. ``close`` releases all of it."""

    def __init__(self, model: HybridModel, block_size: int, snapshot_interval_blocks: int,
                 block_counts: Sequence[int], backends: Sequence[str], seed: int = 0):
        self.model = model
        fp = model.fingerprint
        self._tmp = tempfile.TemporaryDirectory(prefix="tidekv-calibrate-")
        self.ssd_dir = Path(self._tmp.name) / "ssd"
        self.holders = {
            Tier.DRAM: TieredStore(StoreConfig(model_fingerprint=fp, dram_capacity_bytes=_STORE_BYTES)),
            Tier.SSD: TieredStore(StoreConfig(model_fingerprint=fp, dram_capacity_bytes=0,
                                              ssd_capacity_bytes=_STORE_BYTES, ssd_dir=str(self.ssd_dir),
                                              promote_to=Tier.SSD)),
        }
        self.puller = TieredStore(StoreConfig(model_fingerprint=fp, dram_capacity_bytes=_STORE_BYTES))
        self.config = TransferConfig()
        self.receiver = Receiver(self.config, backends=tuple(backends))
        self.senders = {b: connect(self.receiver.addresses[b], self.config) for b in backends}
        self.pulls: dict[int, tuple[list[BlockKey], int]] = {}  # k -> (keys, tensor bytes)
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        policy = SnapshotPolicy(snapshot_interval_blocks, has_state=model.cfg.cache_layout.has_state)
        for k in sorted(set(block_counts)):
            ids = [rng.randrange(model.cfg.vocab_size) for _ in range(k * block_size)]
            keys = chain_keys(ids, block_size, fp)
            snaps = set(policy.snapshot_points(k))
            payloads = [synthetic_block(model, block_size, i in snaps, gen) for i in range(k)]
            for key, payload in zip(keys, payloads, strict=True):
                for tier, store in self.holders.items():
                    if not store.put(key, payload, tier):
                        raise RuntimeError(f"calibration store refused a block in {tier.name}")
            self.pulls[k] = (keys, sum(p.nbytes for p in payloads))
        self._count = 0

    def num_bytes(self, num_blocks: int) -> int:
        return self.pulls[num_blocks][1]

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
        self.receiver.close()
        for store in [*self.holders.values(), self.puller]:
            store.close()
        self._tmp.cleanup()

    def _drop_page_cache(self, keys: Sequence[BlockKey]) -> None:
        # The SSD tier's documented layout: <dir>/<key hex>.blk. Written with fsync, so clean pages drop.
        for key in keys:
            fd = os.open(self.ssd_dir / f"{key.hex()}{BLOCK_SUFFIX}", os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def time_s(self, route: str | Tier, num_blocks: int) -> float:
        """``time_read_s`` for a tier, ``time_link_s`` for a backend name."""
        if isinstance(route, Tier):
            return self.time_read_s(num_blocks, route)
        return self.time_link_s(num_blocks, route)

    def time_read_s(self, num_blocks: int, tier: Tier) -> float:
        """Seconds for the holder to read num_blocks blocks' encoded bytes from tier."""
        keys, _ = self.pulls[num_blocks]
        store = self.holders[tier]
        if tier == Tier.SSD:
            self._drop_page_cache(keys)
        start = time.perf_counter()
        if not store.pin(keys):
            raise RuntimeError("calibration blocks vanished from the holder store")
        try:
            blobs = [store.try_get_encoded(key) for key in keys]
        finally:
            store.unpin(keys)
        elapsed = time.perf_counter() - start
        if any(b is None for b in blobs):
            raise RuntimeError(f"holder's {tier.name} tier lost calibration blocks")
        return elapsed

    def time_link_s(self, num_blocks: int, backend: str) -> float:
        """Seconds to send num_blocks encoded blocks over backend until the puller holds them verified."""
        keys, _ = self.pulls[num_blocks]
        blobs = [self.holders[Tier.DRAM].try_get_encoded(key) for key in keys]
        self._count += 1
        rid, sink, sender = f"calibrate-pull-{self._count}", BlobSink(), self.senders[backend]
        start = time.perf_counter()
        self.receiver.expect(rid, sink, Expected(num_blobs=len(blobs)))
        for i, blob in enumerate(blobs):
            sender.send(rid, i, Kind.BLOB, (0, 0), blob)
        sender.finish(rid, len(blobs))
        self.receiver.wait_complete(rid)
        for i, key in enumerate(keys):
            self.puller.put(key, decode(sink.blobs[i], expected_fingerprint=self.model.fingerprint))
        elapsed = time.perf_counter() - start
        for key in keys:
            self.puller.remove(key)
        return elapsed
