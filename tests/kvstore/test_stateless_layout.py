"""A model without state layers (tiny-k2: all MLA, no KDA) through the store, the hit rule and a
real prefill runner streaming to a decode scheduler: its cache layout declares no state, so its
snapshot is empty, kept at every block, and every block boundary is a reusable prefix; nothing
else changes (same payload format, tiers, transfer and runner code as the hybrid)."""

from __future__ import annotations

import pytest
import torch

import engine
from kvstore.blocks import Tier, chain_keys
from kvstore.device import DeviceTier
from kvstore.hitrule import SnapshotPolicy, leading_present, usable_prefix
from kvstore.payload_format import decode, encode
from kvstore.store import StoreConfig, TieredStore
from prefill_worker.blocks import payload_of_block
from tests.kvstore.test_device_tier import BS, PrefillDecodePair


@pytest.fixture(scope="module")
def k2() -> engine.HybridModel:
    torch.set_num_threads(1)
    return engine.load_model("tiny-k2")


def test_snapshot_policy_without_state_keeps_every_block() -> None:
    policy = SnapshotPolicy(4, has_state=False)
    assert policy.snapshot_points(6) == [0, 1, 2, 3, 4, 5] and policy.snapshot_points(0) == []
    assert all(policy.is_snapshot_point(i, 6) for i in range(6))
    assert SnapshotPolicy(4).snapshot_points(6) == [3, 5]  # the hybrid's, unchanged


def _blocks(model, tokens, interval=4):
    """Every full block of a prefill of ``tokens`` as payloads, at the runner's snapshot points."""
    cache = model.new_cache(-(-len(tokens) // BS), num_slots=1, block_size=BS)
    seq = cache.try_reserve("r", len(tokens))
    policy = SnapshotPolicy(interval, has_state=model.cfg.cache_layout.has_state)
    points = [(i + 1) * BS for i in policy.snapshot_points(len(tokens) // BS)]
    model.prefill(cache, seq, tokens, snapshot_at=points)
    return cache, seq, [payload_of_block(model, cache, seq, i) for i in range(len(tokens) // BS)]


def test_every_block_carries_its_empty_snapshot_through_every_tier(k2, tmp_path) -> None:
    tokens = list(range(300, 300 + 5 * BS))
    cache, seq, payloads = _blocks(k2, tokens)
    assert len(seq.snapshots) == 5  # one per block, not one per 4 blocks; prefill was not cut for them
    for p in payloads:
        assert p.has_snapshot and p.kda_layer_ids == () and p.kda_state.numel() == p.kda_conv.numel() == 0
        assert p.nbytes == len(k2.cfg.mla_layer_ids) * BS * k2.cfg.latent_dim * 4  # rows only
        assert decode(encode(p), expected_fingerprint=k2.fingerprint).same_as(p)
    store = TieredStore(StoreConfig(k2.fingerprint, dram_capacity_bytes=1 << 20, ssd_capacity_bytes=1 << 20,
                                    ssd_dir=str(tmp_path / "ssd")))
    keys = chain_keys(tokens, BS, k2.fingerprint)
    try:
        for i, (key, p) in enumerate(zip(keys, payloads, strict=True)):
            assert store.put(key, p, Tier.SSD if i % 2 else Tier.DRAM)
        assert all(store.has_snapshot(k) for k in keys)
        assert store.try_get(keys[1]).same_as(payloads[1])  # read back from SSD, verified

        def usable_and_present() -> tuple[int, int]:
            present = [store.contains(k) for k in keys]
            return usable_prefix(present, [store.has_snapshot(k) for k in keys]), leading_present(present)

        assert usable_and_present() == (5, 5)
        assert store.remove(keys[3])
        assert usable_and_present() == (3, 3)  # the present run, whole
    finally:
        store.close()
    device = DeviceTier(cache.pool, 1 << 20, k2.fingerprint, k2.cfg.mla_layer_ids, k2.cfg.kda_layer_ids)
    device.adopt(keys[0], seq.pages[0], seq.snapshots[BS])
    assert device.ledger.has_snapshot(keys[0]) and device.sizes_bytes[keys[0]] == device.page_bytes
    assert device.try_get(keys[0]).same_as(payloads[0])
    device.remove(keys[0])
    cache.release(seq)
    cache.check_integrity()


@pytest.mark.parametrize("with_device", [True, False], ids=["in-place", "from-dram"])
def test_runner_reuses_every_shared_block_token_exact(k2, with_device) -> None:
    """5 shared blocks: all 5 reused (the hybrid rule with a snapshot every 2 blocks keeps 4),
    in place on the device tier or copied in from DRAM; the tokens are the engine's."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(300, 8000, (5 * BS,), generator=g).tolist()
    first = shared + torch.randint(300, 8000, (BS + 5,), generator=g).tolist()
    second = shared + torch.randint(300, 8000, (2 * BS + 3,), generator=g).tolist()
    pair = PrefillDecodePair(k2, with_device=with_device)
    try:
        assert pair.generate(first, 6) == (engine.generate(k2, first, 6), 0)
        assert pair.generate(second, 6) == (engine.generate(k2, second, 6), 5 * BS)
        assert pair.last_loaded == (0 if with_device else 5 * BS)
    finally:
        pair.close()
