"""Child process of test_ssd_crash: writes blocks to an SSD-only store until it is killed.

Run as ``python -m tests.kvstore.ssd_writer DIR SEED MAX_BLOCKS`` from the repository root.
Lockstep protocol, one line each way, flushed: the writer prints ``ready`` once its store is
open; then for each block i it waits for a line on stdin (EOF: exit), prints ``begin i``,
puts block i and prints ``done i``. The parent SIGKILLs it right after reading a chosen line,
so a kill lands before any write, inside the put of block i (just after ``begin i``), or
between writes (after ``done i``), without any sleeping; the writer never runs ahead.
"""

from __future__ import annotations

import sys

import torch

from kvstore.blocks import ROOT_KEY, BlockKey, Tier, block_key
from kvstore.payload import BlockPayload, make_random_payload
from kvstore.store import StoreConfig, TieredStore

FP = "crash-test-model"
SSD_CAPACITY_BYTES = 64 << 20


def key_for(seed: int, index: int) -> BlockKey:
    return block_key(ROOT_KEY, [seed, index], FP)


def block_for(seed: int, index: int) -> tuple[BlockKey, BlockPayload]:
    """The key and payload of block ``index`` of run ``seed``; ~256 KiB, every 4th with a snapshot."""
    payload = make_random_payload(
        torch.Generator().manual_seed(seed * 10_000 + index),
        model_fingerprint=FP,
        mla_layer_ids=(3, 7, 11, 15),
        block_size=64,
        latent_dim=256,
        kda_layer_ids=(0, 1, 2) if index % 4 == 3 else (),
        kda_heads=2,
        kda_head_dim=32,
    )
    return key_for(seed, index), payload


def store_config(directory: str) -> StoreConfig:
    return StoreConfig(FP, dram_capacity_bytes=0, ssd_capacity_bytes=SSD_CAPACITY_BYTES, ssd_dir=directory)


def main(argv: list[str]) -> None:
    directory, seed, max_blocks = argv[0], int(argv[1]), int(argv[2])
    torch.set_num_threads(1)
    blocks = [block_for(seed, i) for i in range(max_blocks)]  # generated up front: the loop only writes
    store = TieredStore(store_config(directory))
    print("ready", flush=True)
    for i, (key, payload) in enumerate(blocks):
        if not sys.stdin.readline():
            return
        print(f"begin {i}", flush=True)
        if not store.put(key, payload, tier=Tier.SSD):
            raise SystemExit(f"block {i} did not fit")
        print(f"done {i}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
