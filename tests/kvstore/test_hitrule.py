"""Snapshot placement and the hybrid hit rule: exact cases, and the rule applied by a store."""

from __future__ import annotations

import pytest
import torch

from kvstore.blocks import Tier, chain_keys
from kvstore.hitrule import SnapshotPolicy, leading_present, usable_prefix
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


def _store_with_prompt(tokens: list[int], salt: str, snapshot_at: set[int]) -> TieredStore:
    store = TieredStore(StoreConfig(FP, dram_capacity_bytes=1 << 20))
    gen = torch.Generator().manual_seed(0)
    for i, key in enumerate(chain_keys(tokens, 4, FP, salt)):
        kda = (0, 1) if i in snapshot_at else ()
        assert store.put(key, make_random_payload(gen, model_fingerprint=FP, kda_layer_ids=kda))
    return store


def _usable(store, keys) -> tuple[int, int]:
    """(usable, present) blocks of ``keys`` in ``store``, by the hit rule over what it holds."""
    present = [store.contains(k) for k in keys]
    return usable_prefix(present, [store.has_snapshot(k) for k in keys]), leading_present(present)


def test_the_rule_over_a_store_s_blocks() -> None:
    tokens = list(range(24))  # 6 blocks
    store = _store_with_prompt(tokens, "", snapshot_at={1, 3, 5})
    keys = chain_keys(tokens, 4, FP)
    assert _usable(store, keys) == (6, 6)
    assert store.remove(keys[4])  # MLA hole before the last snapshot
    assert _usable(store, keys) == (4, 4)
    assert _usable(store, keys[:3]) == (2, 3)  # snapshot missing at block 2
    longer = chain_keys(tokens + list(range(100, 108)), 4, FP)
    assert _usable(store, longer) == (4, 4)


def test_salt_mismatch_means_no_match() -> None:
    tokens = list(range(16))
    store = _store_with_prompt(tokens, "tenant-a", snapshot_at={0, 1, 2, 3})
    assert _usable(store, chain_keys(tokens, 4, FP, "tenant-a")) == (4, 4)
    assert _usable(store, chain_keys(tokens, 4, FP, "tenant-b")) == (0, 0)
