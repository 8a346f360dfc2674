"""Snapshot placement and the hybrid hit rule: exact cases, and the rule applied by a store."""

from __future__ import annotations

import pytest
import torch

from kvstore.blocks import Tier, chain_keys
from kvstore.hitrule import MatchResult, SnapshotPolicy, leading_present, match_blocks, usable_prefix
from kvstore.payload import make_random_payload
from kvstore.store import StoreConfig, TieredStore

FP = "kimi-linear-tiny"
D, M, S = Tier.DEVICE, Tier.DRAM, Tier.SSD


@pytest.mark.parametrize(
    ("interval", "num_full_blocks", "expected"),
    [
        (4, 0, []),
        (4, 1, [0]),
        (4, 3, [2]),
        (4, 4, [3]),
        (4, 5, [3, 4]),
        (4, 8, [3, 7]),
        (4, 10, [3, 7, 9]),
        (1, 3, [0, 1, 2]),
    ],
)
def test_snapshot_points(interval: int, num_full_blocks: int, expected: list[int]) -> None:
    policy = SnapshotPolicy(interval)
    assert policy.snapshot_points(num_full_blocks) == expected
    marked = [i for i in range(num_full_blocks) if policy.is_snapshot_point(i, num_full_blocks)]
    assert marked == expected


def test_snapshot_policy_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="positive"):
        SnapshotPolicy(0)
    with pytest.raises(ValueError, match="outside"):
        SnapshotPolicy(2).is_snapshot_point(3, 3)


@pytest.mark.parametrize(
    ("present", "snapshots", "usable"),
    [
        ([], [], 0),
        ([True, True, True], [False, False, False], 0),  # no snapshot anywhere
        ([True, True, True], [False, True, False], 2),  # deepest snapshot wins
        ([True, True, True], [True, False, True], 3),
        ([True, False, True, True], [True, False, False, True], 1),  # MLA hole hides block 3
        ([False, True], [False, True], 0),
        ([M, S, None, M], [False, True, False, True], 2),  # tiers count as present
        ([D, D], [False, True], 2),  # Tier.DEVICE is 0 but present
        ([M, None], [True, True], 1),
    ],
)
def test_usable_prefix(present: list, snapshots: list[bool], usable: int) -> None:
    assert usable_prefix(present, snapshots) == usable


def test_module_docstring_example() -> None:
    present = [True, True, True, True, False, True]
    snapshots = [False, True, False, True, False, True]
    assert usable_prefix(present, snapshots) == 4
    assert leading_present(present) == 4


def test_usable_prefix_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="3 entries but has_snapshot has 2"):
        usable_prefix([True] * 3, [True] * 2)


def test_match_blocks() -> None:
    result = match_blocks([D, M, S, None, M], [False, True, False, False, True], holder="w1")
    assert result == MatchResult(num_blocks=2, num_present_blocks=3, tiers=(D, M), holder="w1")
    assert result.snapshot_block == 1
    assert match_blocks([None], [False]).snapshot_block is None
    with pytest.raises(ValueError):
        MatchResult(num_blocks=2, num_present_blocks=1, tiers=(M, M))


def _store_with_prompt(tokens: list[int], salt: str, snapshot_at: set[int]) -> TieredStore:
    store = TieredStore(StoreConfig(FP, dram_capacity_bytes=1 << 20))
    gen = torch.Generator().manual_seed(0)
    for i, key in enumerate(chain_keys(tokens, 4, FP, salt)):
        kda = (0, 1) if i in snapshot_at else ()
        assert store.put(key, make_random_payload(gen, model_fingerprint=FP, kda_layer_ids=kda))
    return store


def test_store_match_applies_the_hybrid_rule() -> None:
    tokens = list(range(24))  # 6 blocks
    store = _store_with_prompt(tokens, "", snapshot_at={1, 3, 5})
    keys = chain_keys(tokens, 4, FP)
    assert store.match(keys).num_blocks == 6
    assert store.remove(keys[4])  # MLA hole before the last snapshot
    result = store.match(keys)
    assert (result.num_blocks, result.num_present_blocks, result.tiers) == (4, 4, (M,) * 4)
    assert store.match(keys[:3]).num_blocks == 2  # snapshot missing at block 2
    longer = chain_keys(tokens + list(range(100, 108)), 4, FP)
    assert store.match(longer).num_blocks == 4


def test_salt_mismatch_means_no_match() -> None:
    tokens = list(range(16))
    store = _store_with_prompt(tokens, "tenant-a", snapshot_at={0, 1, 2, 3})
    assert store.match(chain_keys(tokens, 4, FP, "tenant-a")).num_blocks == 4
    other = store.match(chain_keys(tokens, 4, FP, "tenant-b"))
    assert (other.num_blocks, other.num_present_blocks) == (0, 0)
