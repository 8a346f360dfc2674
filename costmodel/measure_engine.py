"""Timing the real engine: a prefill the way a prefill worker runs one, and a decode step the
way a decode worker runs one. Returns seconds; fitting is elsewhere.

A timed prefill (``PrefillBench.time_s``) is the worker's path in ``prefill_worker.runner``
minus the network: reserve pages + a KDA slot, read the reused blocks from a DRAM
``TieredStore`` (cut back to the last block with a KDA snapshot), load them into the pages
(``prefill_worker.blocks.resume_from_blocks``, the copy from DRAM), chunked prefill of the new tokens with snapshots at
the worker's snapshot points, sample the first token, store every new full block. Not timed:
block keys (the Conductor computes them) and the layerwise push to the decode worker (it
overlaps compute, and is the transfer engine's cost).

Reused prefixes are synthetic blocks of small random values with the model's shapes:
prefill cost does not depend on the cached values, and computing real ones would cost the
grid's whole budget. A timed decode step (``DecodeBench.time_s``) is ``decode_step`` plus
``sample`` for a batch of equal-length requests, the median of a few steps after one warm-up.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from engine import HybridModel, SamplingParams, sample
from kvstore.blocks import chain_keys
from kvstore.hitrule import SnapshotPolicy
from kvstore.payload import BlockPayload
from kvstore.store import StoreConfig, TieredStore
from prefill_worker.blocks import payload_of_block, resume_from_blocks

_VALUE_SCALE = 0.05  # typical magnitude of cached latents and states; keeps KDA arithmetic tame
_GREEDY = SamplingParams(max_new_tokens=1)


def sync(device: str) -> None:
    """Waits for queued device work so the clock measures it (no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def synthetic_block(model: HybridModel, block_size: int, snapshot: bool, gen: torch.Generator) -> BlockPayload:
    """A block payload of the model's shapes filled with small random values."""
    cfg = model.cfg

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * _VALUE_SCALE

    n_kda = len(cfg.kda_layer_ids)
    return BlockPayload(
        model_fingerprint=model.fingerprint, mla=rand(len(cfg.mla_layer_ids), block_size, cfg.latent_dim),
        mla_layer_ids=cfg.mla_layer_ids,
        kda_state=rand(n_kda, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim) if snapshot else None,
        kda_conv=rand(n_kda, cfg.conv_window_len, cfg.conv_channels) if snapshot else None,
        kda_layer_ids=cfg.kda_layer_ids if snapshot else (),
    )


class PrefillBench:
    """A prefill worker's engine state in miniature: a cache for ``max_tokens``, a DRAM store of
    synthetic reused prefixes (one per reused length), the worker's snapshot policy."""

    def __init__(self, model: HybridModel, block_size: int, snapshot_interval_blocks: int, max_tokens: int,
                 seed: int = 0):
        self.model, self.block_size = model, block_size
        self.policy = SnapshotPolicy(snapshot_interval_blocks, has_state=model.cfg.cache_layout.has_state)
        self.cache = model.new_cache(num_pages=-(-max_tokens // block_size), num_slots=2, block_size=block_size)
        self.store = TieredStore(StoreConfig(model_fingerprint=model.fingerprint, dram_capacity_bytes=16 << 30,
                                             snapshot_interval_blocks=snapshot_interval_blocks))
        self._rng = random.Random(seed)
        self._gen = torch.Generator().manual_seed(seed)
        self._prefixes: dict[int, list[int]] = {}
        self._count = 0

    def close(self) -> None:
        self.store.close()

    def _random_ids(self, n: int) -> list[int]:
        # Byte-level ids below 256 are ordinary text for the tiny tokenizer; any id works for timing.
        return [self._rng.randrange(self.model.cfg.vocab_size) for _ in range(n)]

    def _prefix(self, num_reused: int) -> list[int]:
        """Token ids of a stored prefix of num_reused tokens, its blocks in the store with KDA
        snapshots where a worker would have taken them (its own last block among them)."""
        if num_reused not in self._prefixes:
            ids = self._random_ids(num_reused)
            keys = chain_keys(ids, self.block_size, self.model.fingerprint)
            snaps = set(self.policy.snapshot_points(len(keys)))
            for i, key in enumerate(keys):
                self.store.put(key, synthetic_block(self.model, self.block_size, i in snaps, self._gen))
            self._prefixes[num_reused] = ids
        return self._prefixes[num_reused]

    @torch.inference_mode()
    def time_s(self, num_new: int, num_reused: int) -> float:
        """Seconds of one prefill of num_new tokens after a stored prefix of num_reused tokens."""
        if num_reused % self.block_size:
            raise ValueError(f"reused {num_reused} tokens: not a whole number of {self.block_size}-token blocks")
        bs, model, cache, store = self.block_size, self.model, self.cache, self.store
        ids = self._prefix(num_reused) + self._random_ids(num_new)
        keys = chain_keys(ids, bs, model.fingerprint)
        self._count += 1
        sync(model.device)
        start = time.perf_counter()
        seq = cache.try_reserve(f"calibrate-{self._count}", len(ids))
        if seq is None:
            raise ValueError(f"{len(ids)} tokens do not fit the bench cache of {cache.pool.num_pages} pages")
        try:
            payloads = []
            for key in keys[: num_reused // bs]:
                payload = store.try_get(key)
                if payload is None:
                    break
                payloads.append(payload)
            while payloads and not payloads[-1].has_snapshot:
                payloads.pop()
            cached = resume_from_blocks(model, cache, seq, 0, None, payloads)
            points = [(i + 1) * bs for i in self.policy.snapshot_points(len(ids) // bs)]
            logits = model.prefill(cache, seq, ids[cached:], snapshot_at=[q for q in points if q > cached])
            sample(logits, [_GREEDY], [len(ids)])
            for i in range(cached // bs, len(keys)):
                if not store.contains(keys[i]):
                    store.put(keys[i], payload_of_block(model, cache, seq, i))
            sync(model.device)
            elapsed = time.perf_counter() - start
        finally:
            cache.release(seq)
            for key in keys[num_reused // bs :]:
                store.remove(key)
        assert cached == num_reused, f"reused {cached} of {num_reused} stored tokens"
        return elapsed


class DecodeBench:
    """A decode worker's cache for up to ``max_batch`` requests of ``max_context`` tokens each,
    filled with small random values (decode cost does not depend on them)."""

    def __init__(self, model: HybridModel, block_size: int, max_batch: int, max_context: int, max_steps: int,
                 seed: int = 0):
        self.model, self.block_size = model, block_size
        pages = -(-(max_context + max_steps + 1) // block_size)
        self.cache = model.new_cache(num_pages=max_batch * pages, num_slots=max_batch, block_size=block_size)
        gen = torch.Generator(device=model.device).manual_seed(seed)
        kv = self.cache.pool.kv
        kv.copy_(torch.randn(kv.shape, generator=gen, device=kv.device, dtype=kv.dtype) * _VALUE_SCALE)
        self._rng = random.Random(seed)

    @torch.inference_mode()
    def time_s(self, batch_size: int, context_per_request: int, steps: int) -> float:
        """Median seconds of ``steps`` decode steps (after one warm-up) of batch_size requests
        that each hold context_per_request tokens."""
        cache, model = self.cache, self.model
        seqs = []
        try:
            for i in range(batch_size):
                seq = cache.try_reserve(f"decode-{i}", context_per_request + steps + 1)
                if seq is None:
                    raise ValueError(f"batch {batch_size} x {context_per_request} tokens exceeds the bench cache")
                seq.num_tokens = context_per_request
                cache.slots.state[:, seq.slot].normal_(0.0, _VALUE_SCALE)
                cache.slots.conv[:, seq.slot].normal_(0.0, _VALUE_SCALE)
                seqs.append(seq)
            params = [_GREEDY] * batch_size
            tokens = [self._rng.randrange(256) for _ in seqs]
            samples = []
            for step in range(steps + 1):
                sync(model.device)
                start = time.perf_counter()
                logits = model.decode_step(cache, seqs, tokens)
                tokens = sample(logits, params, [s.num_tokens for s in seqs])
                sync(model.device)
                if step:  # step 0 warms up
                    samples.append(time.perf_counter() - start)
            return statistics.median(samples)
        finally:
            for seq in seqs:
                cache.release(seq)
