"""TieredStore: exact placement, demotion, promotion, pins and events at tiny sizes; SSD
verification (a corrupt block is dropped, published as removed, counted and logged) and
restart; and a contract test run over every registered eviction policy."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from engine.cache import PagePool
from kvstore.blocks import BlockKey, Tier, block_key, chain_keys
from kvstore.device import DeviceTier
from kvstore.eviction import POLICIES
from kvstore.metrics import StoreMetrics
from kvstore.payload import BlockPayload, make_random_payload
from kvstore.payload_format import PayloadError, encode, encoded_nbytes
from kvstore.store import StoreConfig, StoreEvent, TieredStore
from runtime.metrics import Identity

FP = "kimi-linear-tiny"
D, M, S = Tier.DEVICE, Tier.DRAM, Tier.SSD
MLA_LAYERS = (3, 7)


def payload(seed: int, snapshot: bool = False) -> BlockPayload:
    return make_random_payload(
        torch.Generator().manual_seed(seed),
        model_fingerprint=FP,
        mla_layer_ids=MLA_LAYERS,
        block_size=4,
        latent_dim=8,
        kda_layer_ids=(0, 1) if snapshot else (),
    )


BLOCK_BYTES = encoded_nbytes(payload(0))
SNAPSHOT_BYTES = encoded_nbytes(payload(0, snapshot=True))
KEYS = chain_keys(list(range(4 * 40)), 4, FP)


def device_tier(num_pages: int, capacity_bytes: int) -> DeviceTier:
    pool = PagePool(len(MLA_LAYERS), num_pages, 4, 8)
    return DeviceTier(pool, capacity_bytes, FP, MLA_LAYERS)


class Recorder:
    """Collects events and replays them into the key -> tier map a global index would hold."""

    def __init__(self) -> None:
        self.events: list[StoreEvent] = []

    def __call__(self, event: StoreEvent) -> None:
        self.events.append(event)

    def take(self) -> list[tuple[str, int, Tier]]:
        out = [(e.kind, KEYS.index(e.key), e.tier) for e in self.events]
        self.events.clear()
        return out

    def replay(self, events: list[StoreEvent]) -> dict[BlockKey, Tier]:
        held: dict[BlockKey, Tier] = {}
        for e in events:
            if e.kind == "removed":
                assert held.pop(e.key) == e.tier
            else:
                held[e.key] = e.tier
        return held


@pytest.fixture
def events() -> Recorder:
    return Recorder()


@pytest.fixture
def make_store(tmp_path: Path, events: Recorder) -> Iterator:
    stores: list[TieredStore] = []

    def make(dram_blocks: int = 0, ssd_blocks: int = 0, device: DeviceTier | None = None, **kw) -> TieredStore:
        config = StoreConfig(
            FP,
            dram_capacity_bytes=dram_blocks * BLOCK_BYTES,
            ssd_capacity_bytes=ssd_blocks * BLOCK_BYTES,
            ssd_dir=str(tmp_path / "ssd"),
            **kw,
        )
        store = TieredStore(config, device=device, on_event=events)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.check_integrity()
        store.close()


# ----- exact mechanism -------------------------------------------------------------------


def test_put_get_round_trip(make_store, events: Recorder) -> None:
    store = make_store(dram_blocks=2)
    assert store.put(KEYS[0], payload(0))
    assert store.contains(KEYS[0]) and store.tier_of(KEYS[0]) == M
    assert store.used_bytes(M) == BLOCK_BYTES
    got = store.try_get(KEYS[0])
    assert got is not None and got.same_as(payload(0))
    got.mla.zero_()  # the caller owns the returned tensors
    assert store.try_get(KEYS[0]).same_as(payload(0))
    assert store.try_get(KEYS[1]) is None
    assert events.take() == [("stored", 0, M)]


def test_dram_demotes_to_ssd_then_drops_in_lru_order(make_store, events: Recorder) -> None:
    store = make_store(dram_blocks=3, ssd_blocks=2)
    for i in range(6):
        assert store.put(KEYS[i], payload(i))
        assert store.used_bytes(M) <= 3 * BLOCK_BYTES and store.used_bytes(S) <= 2 * BLOCK_BYTES
    assert sorted(map(KEYS.index, store.keys(M))) == [3, 4, 5]
    assert sorted(map(KEYS.index, store.keys(S))) == [1, 2]
    assert events.take() == [
        ("stored", 0, M), ("stored", 1, M), ("stored", 2, M),
        ("moved", 0, S), ("stored", 3, M),
        ("moved", 1, S), ("stored", 4, M),
        ("removed", 0, S), ("moved", 2, S), ("stored", 5, M),
    ]  # fmt: skip
    # A hit on SSD promotes to DRAM; DRAM's LRU block (3) takes the room it left on SSD.
    assert store.try_get(KEYS[1]).same_as(payload(1))
    assert events.take() == [("moved", 3, S), ("moved", 1, M)]
    assert store.tier_of(KEYS[1]) == M and store.tier_of(KEYS[3]) == S
    assert store.tier_of(KEYS[2]) == S


def test_demotion_chain_from_device(make_store, events: Recorder) -> None:
    device = device_tier(num_pages=2, capacity_bytes=2 * 256)
    store = make_store(dram_blocks=1, ssd_blocks=1, device=device)
    for i in range(5):
        assert store.put(KEYS[i], payload(i), tier=D)
    assert events.take() == [
        ("stored", 0, D), ("stored", 1, D),
        ("moved", 0, M), ("stored", 2, D),
        ("moved", 0, S), ("moved", 1, M), ("stored", 3, D),
        ("removed", 0, S), ("moved", 1, S), ("moved", 2, M), ("stored", 4, D),
    ]  # fmt: skip
    assert [store.tier_of(k) for k in KEYS[:5]] == [None, S, M, D, D]
    assert {device.page_of(KEYS[3]), device.page_of(KEYS[4])} == {0, 1}
    assert store.page_of(KEYS[3]) == device.page_of(KEYS[3])
    for i in range(1, 5):  # bytes survive every hop: device -> DRAM (encode) -> SSD (file)
        assert store.try_get(KEYS[i]).same_as(payload(i))


def test_device_tier_keeps_snapshots_and_fails_softly_without_pages(make_store) -> None:
    device = device_tier(num_pages=1, capacity_bytes=1 << 20)
    store = make_store(device=device)
    assert store.put(KEYS[0], payload(0, snapshot=True), tier=D)
    assert store.has_snapshot(KEYS[0])
    assert store.try_get(KEYS[0]).same_as(payload(0, snapshot=True))
    store.pin([KEYS[0]])
    assert not store.put(KEYS[1], payload(1), tier=D)  # bytes fit, but the only page is pinned
    store.unpin([KEYS[0]])
    assert store.put(KEYS[1], payload(1), tier=D)  # evicts block 0 to free its page
    assert store.tier_of(KEYS[0]) is None and device.page_of(KEYS[1]) == 0
    wrong_shape = make_random_payload(torch.Generator(), model_fingerprint=FP, mla_layer_ids=MLA_LAYERS, latent_dim=6)
    with pytest.raises(ValueError, match="does not match the pool"):
        store.put(KEYS[2], wrong_shape, tier=D)


def test_pins_block_eviction_and_are_counted(make_store, events: Recorder) -> None:
    store = make_store(dram_blocks=2)
    store.put(KEYS[0], payload(0))
    store.put(KEYS[1], payload(1))
    assert store.pin([KEYS[0], KEYS[1]]) and store.pin([KEYS[0]])
    assert not store.pin([KEYS[0], KEYS[5]])  # all or nothing
    assert store.pin_count(KEYS[0]) == 2 and store.pin_count(KEYS[5]) == 0
    events.take()
    assert not store.put(KEYS[2], payload(2))  # doesn't fit: everything is pinned
    assert events.take() == [] and store.used_bytes(M) == 2 * BLOCK_BYTES
    assert not store.remove(KEYS[1])
    store.unpin([KEYS[1]])
    assert store.put(KEYS[2], payload(2))
    assert events.take() == [("removed", 1, M), ("stored", 2, M)]
    with pytest.raises(ValueError, match="pinned 0 times"):
        store.unpin([KEYS[1]])
    with pytest.raises(ValueError, match="x3"):
        store.unpin([KEYS[0]] * 3)
    assert store.pin_count(KEYS[0]) == 2  # the failed unpin changed nothing
    store.unpin([KEYS[0], KEYS[0]])
    assert store.pin_count(KEYS[0]) == 0


def test_put_falls_back_to_a_slower_tier(make_store) -> None:
    store = make_store(dram_blocks=1, ssd_blocks=1)
    store.put(KEYS[0], payload(0))
    store.pin([KEYS[0]])
    assert store.put(KEYS[1], payload(1))
    assert store.tier_of(KEYS[1]) == S
    assert store.try_get(KEYS[1]).same_as(payload(1))
    assert store.tier_of(KEYS[1]) == S  # DRAM is pinned full: no promotion, still a hit
    store.unpin([KEYS[0]])


def test_block_larger_than_every_tier_does_not_fit(make_store) -> None:
    store = make_store(dram_blocks=1, ssd_blocks=1)
    assert not store.put(KEYS[0], payload(0, snapshot=True))
    assert not store.contains(KEYS[0])


def test_snapshot_upgrade_replaces_a_block_without_one(make_store, events: Recorder) -> None:
    store = make_store(dram_blocks=8)
    store.put(KEYS[0], payload(0))
    assert not store.has_snapshot(KEYS[0])
    assert store.put(KEYS[0], payload(0, snapshot=True))
    assert store.has_snapshot(KEYS[0]) and store.used_bytes(M) == SNAPSHOT_BYTES
    assert store.put(KEYS[0], payload(0))  # present: only touched
    assert store.has_snapshot(KEYS[0])
    assert [(e.kind, e.has_snapshot) for e in events.events] == [("stored", False), ("stored", True)]


def test_contract_violations_raise(make_store) -> None:
    store = make_store(dram_blocks=2)
    with pytest.raises(ValueError, match="payload is for 'other'"):
        store.put(KEYS[0], make_random_payload(torch.Generator(), model_fingerprint="other"))
    with pytest.raises(ValueError, match="16 bytes"):
        store.put(b"short", payload(0))
    with pytest.raises(ValueError, match="not configured"):
        store.put(KEYS[0], payload(0), tier=S)
    with pytest.raises(ValueError, match="at least one tier"):
        TieredStore(StoreConfig(FP, dram_capacity_bytes=0))
    with pytest.raises(ValueError, match="unknown eviction policy"):
        StoreConfig(FP, eviction_policy="mru")
    with pytest.raises(ValueError, match="needs ssd_dir"):
        StoreConfig(FP, ssd_capacity_bytes=1)


def test_put_encoded_verifies_and_try_get_encoded_returns_the_bytes(make_store) -> None:
    store = make_store(dram_blocks=2, ssd_blocks=2)
    blob = encode(payload(3))
    with pytest.raises(PayloadError, match="body checksum"):
        store.put_encoded(KEYS[0], blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(PayloadError, match="fingerprint"):
        store.put_encoded(KEYS[0], encode(make_random_payload(torch.Generator(), model_fingerprint="x")))
    assert store.put_encoded(KEYS[0], blob, tier=S)
    assert store.try_get_encoded(KEYS[0]) == blob
    assert store.tier_of(KEYS[0]) == M


def test_corrupt_ssd_file_is_dropped_on_read(make_store, events: Recorder, tmp_path: Path) -> None:
    store = make_store(ssd_blocks=2)
    store.put(KEYS[0], payload(0), tier=S)
    path = tmp_path / "ssd" / f"{KEYS[0].hex()}.blk"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(data)
    assert store.try_get(KEYS[0]) is None
    assert not store.contains(KEYS[0]) and not path.exists()
    assert events.take() == [("stored", 0, S), ("removed", 0, S)]


def test_corrupt_ssd_block_is_counted_logged_published_and_can_be_stored_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    registry = CollectorRegistry()
    identity = Identity("prefill-t", "prefill", "tiny")
    seen: list[StoreEvent] = []
    config = StoreConfig(FP, dram_capacity_bytes=BLOCK_BYTES, ssd_capacity_bytes=4 * SNAPSHOT_BYTES,
                         ssd_dir=str(tmp_path / "ssd"))
    with TieredStore(config, on_event=seen.append, metrics=StoreMetrics(identity, registry)) as store:
        assert store.put(KEYS[0], payload(0, snapshot=True))  # larger than DRAM: lands on SSD
        assert store.tier_of(KEYS[0]) == S
        path = tmp_path / "ssd" / f"{KEYS[0].hex()}.blk"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # inside the tensor sections
        path.write_bytes(data)
        with caplog.at_level(logging.WARNING, logger="kvstore.ssd"):
            assert store.try_get(KEYS[0]) is None
        assert f"block {KEYS[0].hex()} is corrupt on disk" in caplog.text
        # The index learns the block is gone, with what it carried.
        assert seen[-1] == StoreEvent("removed", KEYS[0], S, has_snapshot=True)
        labels = {**identity.labels, "where": "ssd"}
        assert registry.get_sample_value("tidekv:kv_corruption_total", labels) == 1
        assert not store.contains(KEYS[0]) and not path.exists()
        store.check_integrity()
        assert store.put(KEYS[0], payload(0, snapshot=True))  # recomputed by the caller, stored again
        assert store.try_get(KEYS[0]).same_as(payload(0, snapshot=True))
        assert registry.get_sample_value("tidekv:kv_corruption_total", labels) == 1
        store.check_integrity()


def test_restart_rescans_ssd_and_republishes(make_store, events: Recorder) -> None:
    first = make_store(dram_blocks=1, ssd_blocks=8)
    for i in range(3):
        first.put(KEYS[i], payload(i, snapshot=(i == 1)), tier=S if i < 2 else M)
    first.close()
    events.take()
    second = make_store(dram_blocks=1, ssd_blocks=8)  # same directory
    assert sorted(e[1] for e in events.take()) == [0, 1]
    assert second.has_snapshot(KEYS[1]) and not second.contains(KEYS[2])  # DRAM is volatile
    assert second.try_get(KEYS[1]).same_as(payload(1, snapshot=True))
    assert second.contains(KEYS[0]) and second.has_snapshot(KEYS[1])


def test_check_integrity_detects_broken_invariants(make_store) -> None:
    store = make_store(dram_blocks=2)
    store.put(KEYS[0], payload(0))
    store.check_integrity()
    ledger = store._placement.tiers[M].ledger
    ledger.used_bytes += 1
    with pytest.raises(AssertionError, match="used_bytes"):
        store.check_integrity()
    ledger.used_bytes -= 1
    store._placement.where[KEYS[1]] = M
    with pytest.raises(AssertionError, match="disagrees"):
        store.check_integrity()
    del store._placement.where[KEYS[1]]
    store._placement.policies[M].on_remove(KEYS[0])
    with pytest.raises(AssertionError, match="policy"):
        store.check_integrity()
    store._placement.policies[M].on_insert(KEYS[0])


# ----- contract over every policy --------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_random_operations_keep_every_invariant(make_store, events: Recorder, policy: str) -> None:
    rng = random.Random(1234)
    device = device_tier(num_pages=3, capacity_bytes=3 * 256 + 2 * 1088)
    store = make_store(dram_blocks=4, ssd_blocks=6, device=device, eviction_policy=policy, promote_to=D)
    keys = [block_key(KEYS[0], [i], FP) for i in range(16)]
    expected = {key: payload(i, snapshot=(i % 3 == 0)) for i, key in enumerate(keys)}
    pins: dict[BlockKey, int] = {}
    for _ in range(300):
        key = rng.choice(keys)
        op = rng.random()
        if op < 0.35:
            store.put(key, expected[key], tier=rng.choice([D, M, S]))
        elif op < 0.7:
            got = store.try_get(key)
            assert got is None or got.same_as(expected[key])
        elif op < 0.8 and store.pin([key]):
            pins[key] = pins.get(key, 0) + 1
        elif op < 0.9 and pins.get(key):
            store.unpin([key])
            pins[key] -= 1
        elif op < 0.95:
            present = store.contains(key)
            assert store.remove(key) == (present and not pins.get(key))
        for tier in store.tiers:
            assert store.used_bytes(tier) <= store.capacity_bytes(tier)
        assert all(store.contains(k) for k, n in pins.items() if n), "a pinned block was evicted"
        store.check_integrity()
    kinds = {e.kind for e in events.events}
    assert kinds == {"stored", "moved", "removed"}
    assert {e.tier for e in events.events if e.kind == "moved"} == {M, S, D}  # demoted and promoted
    held = events.replay(events.events)
    assert held == {key: store.tier_of(key) for key in keys if store.contains(key)}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_concurrent_callers_keep_invariants(make_store, policy: str) -> None:
    store = make_store(dram_blocks=3, ssd_blocks=4, eviction_policy=policy)
    blocks = [(KEYS[i], payload(i)) for i in range(12)]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            key, data = rng.choice(blocks)
            if rng.random() < 0.5:
                store.put(key, data)
            else:
                got = store.try_get(key)
                assert got is None or got.same_as(data)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.check_integrity()
    assert store.used_bytes(M) <= 3 * BLOCK_BYTES
