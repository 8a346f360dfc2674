"""The device tier: cached prefix blocks kept in the prefill worker's own page pool and reused
in place.

- A prefill that reuses a prefix in place produces the same tokens as one that loads it from
  DRAM, and as the single-process reference (a real ``PrefillRunner`` streaming over tcp to a
  real ``DecodeScheduler``).
- Copy-on-write: a request writing into a shared page gets its own copy; the page the others
  hold is unchanged, byte for byte.
- Pinned blocks (those a running request reuses) are never evicted to free pages.
- Every page's holders are exactly the live requests plus the device tier
  (``CacheManager.check_integrity``), checked after every test.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest
import torch

import engine
from decode_worker.scheduler import DecodeScheduler, Finished
from decode_worker.sink import expected_for, sink_for
from engine.cache import PagePool
from engine.sampler import SamplingParams
from kvstore.blocks import Tier, chain_keys
from kvstore.device import DeviceTier
from kvstore.hitrule import usable_prefix
from kvstore.payload import make_random_payload
from kvstore.store import StoreConfig, TieredStore
from kvstore.transfer.base import TransferConfig
from kvstore.transfer.receiver import Receiver
from prefill_worker.runner import PrefillRunner
from prefill_worker.transfers import TransferHub
from runtime.calls import PrefillCall

BS = 16
SNAPSHOT_EVERY = 2


@pytest.fixture(scope="module")
def model() -> engine.HybridModel:
    torch.set_num_threads(1)
    return engine.load_model("tiny")


class PrefillDecodePair:
    """A prefill runner (with or without a device tier) streaming to a decode scheduler in
    this process, over the real tcp transfer engine."""

    def __init__(self, model: engine.HybridModel, with_device: bool, num_pages: int = 64):
        self.model = model
        self.tmp = tempfile.TemporaryDirectory(prefix="tidekv-device-")
        self.cache = model.new_cache(num_pages, num_slots=2, block_size=BS)
        device = None
        if with_device:
            device = DeviceTier(self.cache.pool, 1 << 30, model.fingerprint, model.cfg.mla_layer_ids,
                                model.cfg.kda_layer_ids)
        self.store = TieredStore(StoreConfig(model.fingerprint, dram_capacity_bytes=64 << 20,
                                             snapshot_interval_blocks=SNAPSHOT_EVERY), device=device)
        self.hub = TransferHub(TransferConfig())
        self.runner = PrefillRunner(model, self.store, self.hub, self.cache, SNAPSHOT_EVERY)
        self.scheduler = DecodeScheduler(model, 256, 4, BS)
        self.scheduler.start()
        self.receiver = Receiver(TransferConfig())
        self._n = 0

    def generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
        """The tokens (first one from the prefill) and the number of prompt tokens reused."""
        self._n += 1
        rid = f"r{self._n}"
        keys = tuple(chain_keys(prompt, BS, self.model.fingerprint))
        reuse_cap = (len(prompt) - 1) // BS  # the last prompt token is always computed
        held = keys[:reuse_cap]
        planned = usable_prefix([self.store.contains(k) for k in held], [self.store.has_snapshot(k) for k in held])
        seq = self.scheduler.try_reserve(rid, len(prompt) + max_tokens)
        assert seq is not None
        sc = self.scheduler.cache
        self.receiver.expect(rid, sink_for(sc, seq), expected_for(sc, len(prompt)), 30.0)
        params = SamplingParams(max_new_tokens=max_tokens)
        out = self.runner.run(PrefillCall(rid, tuple(prompt), params, keys, planned, self.receiver.address, 30.0),
                              lambda: False)
        self.receiver.wait_complete(rid, 30.0)
        tokens = [out.first_token]
        q = self.scheduler.start_decoding(rid, len(prompt), out.first_token, params)
        while True:
            item = q.get(timeout=30)
            if isinstance(item, Finished):
                break
            tokens.extend(item)
        self.scheduler.release(rid)
        self.runner.check_integrity()
        self.last_loaded = out.loaded_tokens
        return tokens[:max_tokens], out.cached_tokens

    def close(self) -> None:
        self.runner.check_integrity()
        self.scheduler.stop()
        self.receiver.close()
        self.hub.close()
        self.store.close()
        self.tmp.cleanup()


@pytest.fixture
def pairs(model) -> Iterator:
    made: list[PrefillDecodePair] = []

    def make(with_device: bool, num_pages: int = 64) -> PrefillDecodePair:
        made.append(PrefillDecodePair(model, with_device, num_pages))
        return made[-1]

    yield make
    for pair in made:
        pair.close()


def prompts() -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(300, 8000, (4 * BS,), generator=g).tolist()
    first = shared + torch.randint(300, 8000, (BS + 5,), generator=g).tolist()
    second = shared + torch.randint(300, 8000, (2 * BS + 3,), generator=g).tolist()
    return first, second


def test_prefix_reused_in_place_matches_dram_and_the_reference(model, pairs) -> None:
    first, second = prompts()
    device, dram = pairs(with_device=True), pairs(with_device=False)
    want = [engine.generate(model, p, 6) for p in (first, second)]

    assert device.generate(first, 6) == (want[0], 0)
    assert all(device.store.tier_of(k) == Tier.DEVICE for k in chain_keys(first, BS, model.fingerprint))
    free_before = device.cache.pool.num_free
    tokens, cached = device.generate(second, 6)
    assert (tokens, cached) == (want[1], 4 * BS)  # 4 shared blocks, the 4th carries a snapshot
    assert device.last_loaded == 0  # all reused in place
    assert device.cache.pool.num_free == free_before - 2  # only the 2 new full blocks took pages

    assert dram.generate(first, 6) == (want[0], 0)
    assert all(dram.store.tier_of(k) == Tier.DRAM for k in chain_keys(first, BS, model.fingerprint))
    assert dram.generate(second, 6) == (want[1], 4 * BS)
    assert dram.last_loaded == 4 * BS  # all copied in from DRAM


def test_a_dram_block_reused_moves_to_the_device_in_the_page_it_was_loaded_into(model, pairs) -> None:
    first, second = prompts()
    pair = pairs(with_device=True)
    pair.generate(first, 2)
    keys = chain_keys(first, BS, model.fingerprint)
    assert pair.store.free_device_pages(pair.cache.pool.num_pages)  # demote every cached block
    assert [pair.store.tier_of(k) for k in keys] == [Tier.DRAM] * len(keys)
    tokens, cached = pair.generate(second, 4)
    assert (tokens, cached) == (engine.generate(model, second, 4), 4 * BS)
    assert pair.last_loaded == 4 * BS
    assert [pair.store.tier_of(k) for k in keys[:4]] == [Tier.DEVICE] * 4
    assert pair.store.has_snapshot(keys[3])  # the snapshot came along


def test_copy_on_write_leaves_the_shared_page_untouched(model) -> None:
    cache = model.new_cache(8, num_slots=2, block_size=BS)
    prompt = list(range(300, 300 + 2 * BS))
    a = cache.try_reserve("a", 2 * BS)
    model.prefill(cache, a, prompt, snapshot_at=[BS])
    shared = list(a.pages)
    before = cache.pool.kv[:, shared].clone()

    # b shares both of a's pages but resumes mid-block: its first write lands in shared page 1.
    b = cache.try_reserve("b", 3 * BS, shared_pages=shared)
    assert b.pages[:2] == shared and cache.pool.refcount(shared[1]) == 2
    cache.slots.state[:, b.slot] = a.snapshots[BS][0]
    cache.slots.conv[:, b.slot] = a.snapshots[BS][1]
    b.num_tokens = BS
    model.prefill(cache, b, list(range(900, 900 + 2 * BS)))
    assert b.pages[0] == shared[0] and b.pages[1] != shared[1]  # page 1 was copied before the write
    assert torch.equal(cache.pool.kv[:, shared], before)  # a's pages untouched, byte for byte
    assert torch.equal(cache.pool.kv[:, b.pages[0]], before[:, 0])
    assert cache.pool.refcount(shared[1]) == 1
    cache.check_integrity()

    cache.release(b)
    cache.release(a)
    cache.check_integrity()
    assert cache.pool.num_free == 8


def test_decode_into_a_shared_page_copies_it(model) -> None:
    cache = model.new_cache(4, num_slots=2, block_size=BS)
    a = cache.try_reserve("a", BS)
    model.prefill(cache, a, list(range(300, 300 + BS - 1)))
    b = cache.try_reserve("b", BS, shared_pages=a.pages)
    b.num_tokens = a.num_tokens
    before = cache.pool.kv[:, a.pages[0]].clone()
    model.decode_step(cache, [b], [7])
    assert b.pages[0] != a.pages[0] and torch.equal(cache.pool.kv[:, a.pages[0]], before)
    cache.release(a)
    cache.release(b)
    cache.check_integrity()


def test_pinned_device_blocks_are_never_evicted_to_free_pages() -> None:
    fp, layers = "fp", (2, 5)
    pool = PagePool(len(layers), 4, BS, 8)
    device = DeviceTier(pool, 1 << 20, fp, layers)
    store = TieredStore(StoreConfig(fp, dram_capacity_bytes=1 << 20), device=device)
    keys = chain_keys(list(range(4 * BS)), BS, fp)
    g = torch.Generator().manual_seed(1)
    for key in keys:
        payload = make_random_payload(g, model_fingerprint=fp, mla_layer_ids=layers, block_size=BS, latent_dim=8)
        assert store.put(key, payload, tier=Tier.DEVICE)
    assert pool.num_free == 0
    assert [page for page, _ in store.pin_device_prefix(keys[:2])] == [device.page_of(k) for k in keys[:2]]
    assert store.num_evictable_device_blocks() == 2

    assert not store.free_device_pages(3)  # only the 2 unpinned blocks can go
    assert [store.tier_of(k) for k in keys] == [Tier.DEVICE, Tier.DEVICE, Tier.DRAM, Tier.DRAM]
    assert pool.num_free == 2
    store.unpin(keys[:2])
    assert store.free_device_pages(3)
    assert pool.num_free == 3 and store.tier_of(keys[0]) == Tier.DRAM
    store.check_integrity()
    pool.check_integrity(device.held_pages())


def test_a_running_request_keeps_its_pinned_prefix_while_the_pool_runs_short(model, pairs) -> None:
    """The pool is so small that the second prefill must demote cached blocks to get pages; it
    demotes the others, never the prefix it is reusing, and stays token-exact."""
    first, second = prompts()
    pair = pairs(with_device=True, num_pages=7)
    pair.generate(first, 2)  # its 5 full blocks stay on the device: 2 pages free
    assert pair.cache.pool.num_free == 2
    keys = chain_keys(first, BS, model.fingerprint)
    tokens, cached = pair.generate(second, 3)
    assert (tokens, cached) == (engine.generate(model, second, 3), 4 * BS)
    assert [pair.store.tier_of(k) for k in keys[:4]] == [Tier.DEVICE] * 4
    assert pair.store.tier_of(keys[4]) == Tier.DRAM  # demoted to make room for 3 new pages
