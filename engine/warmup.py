"""Warm-up: run the kernels and fill the allocator before a worker reports SERVING.

The first call of each shape pays for lazy initialisation: kernel selection, the caching
allocator's first blocks on CUDA, and the first touch of the weights' pages on CPU. A worker
calls ``warm_up`` on a scratch cache of its own before it registers. That way the first real
request's TTFT is a steady-state TTFT. The pages of the worker's pool are not touched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.model import HybridModel


def warm_up(model: HybridModel, block_size: int, prefill_tokens: Sequence[int] = (),
            batch_sizes: Sequence[int] = (1, 8)) -> float:
    """Prefills of ``prefill_tokens`` lengths (default: one block and one full chunk), then a
    decode step at each batch size; returns the seconds it took."""
    t0 = time.perf_counter()
    lengths = list(prefill_tokens) or [block_size, model.prefill_chunk_tokens + block_size]
    batch = max(batch_sizes, default=1)
    longest = max(lengths) + 2
    pages = batch * -(-longest // block_size)
    cache = model.new_cache(num_pages=pages, num_slots=batch, block_size=block_size)
    vocab = model.cfg.vocab_size
    with torch.inference_mode():
        seqs = []
        for i in range(batch):
            seq = cache.try_reserve(f"warm-up-{i}", longest)
            n = lengths[i % len(lengths)] if i < len(lengths) else block_size
            model.prefill(cache, seq, [(7 * j + i) % vocab for j in range(n)])
            seqs.append(seq)
        for b in batch_sizes if getattr(model, "supports_decode", True) else ():  # a pipelined instance prefills only
            model.decode_step(cache, seqs[:b], [1] * b)
        for seq in seqs:
            cache.release(seq)
    if str(model.device).startswith("cuda"):
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - t0
