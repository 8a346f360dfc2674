"""Every place that decides how much of a held prefix is usable agrees with ``kvstore.hitrule``:
the cluster's block index (what the Conductor routes on), the prefill runner (what a live
worker reuses) and the simulator's prefill worker, on random layouts of present and missing
blocks, tiers and KDA snapshots. None of them has a hit rule of its own to drift."""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass

import pytest
import torch

import engine
from clusterstate.state import ClusterState
from clusterstate.workers import WorkerInfo, WorkerRole
from costmodel import CostModels
from engine.sampler import SamplingParams
from kvstore.blocks import BlockKey, Tier, chain_keys
from kvstore.hitrule import usable_prefix
from kvstore.index import BlockEvent
from kvstore.payload import make_random_payload
from kvstore.sized import SizedBlob
from kvstore.store import StoreConfig, TieredStore
from kvstore.transfer.base import TransferConfig
from prefill_worker.config import PrefillConfig
from prefill_worker.runner import PrefillRunner, Reuse
from prefill_worker.transfers import TransferHub
from replay.sim.events import EventLoop
from replay.sim.prefill import SimPrefill, SimPrefillJob
from runtime.calls import PrefillCall

BS = 16
NUM_LAYOUTS = 60


@dataclass(frozen=True)
class Layout:
    """Block i of the prompt is held at ``tiers[i]`` (None: missing) with a snapshot or not."""

    tiers: tuple[Tier | None, ...]
    snapshots: tuple[bool, ...]

    @property
    def expected(self) -> int:
        return usable_prefix(list(self.tiers), list(self.snapshots))


def layouts(seed: int, tiers: tuple[Tier, ...]) -> list[Layout]:
    rng = random.Random(seed)
    out = [Layout((), ())]
    for _ in range(NUM_LAYOUTS):
        n = rng.randint(1, 12)
        held = tuple(None if rng.random() < 0.12 else rng.choice(tiers) for _ in range(n))
        out.append(Layout(held, tuple(rng.random() < 0.35 for _ in range(n))))
    # Layouts that exercise the rule's edges: all held without snapshots, all held with one at the end.
    out += [Layout((tiers[0],) * 5, (False,) * 5), Layout((tiers[-1],) * 5, (False,) * 4 + (True,))]
    return out


def prompt_keys(i: int, num_blocks: int, fingerprint: str) -> tuple[list[int], tuple[BlockKey, ...]]:
    tokens = [(i * 977 + j * 31) % 5000 + 300 for j in range(num_blocks * BS + 1)]
    return tokens, tuple(chain_keys(tokens, BS, fingerprint))


def test_the_block_index_agrees_with_the_hit_rule() -> None:
    state = ClusterState(ttl_s=1e9)
    assert state.register(WorkerInfo("prefill-0", WorkerRole.PREFILL, "rpc", 100))
    for i, layout in enumerate(layouts(1, (Tier.DEVICE, Tier.DRAM, Tier.SSD))):
        _, keys = prompt_keys(i, len(layout.tiers), "fp")
        state.apply([BlockEvent.stored("prefill-0", k, t, s)
                     for k, t, s in zip(keys, layout.tiers, layout.snapshots, strict=True) if t is not None])
        match = {m.worker_id: m for m in state.match(keys).matches}.get("prefill-0")
        usable = match.num_blocks_usable if match is not None else 0
        assert usable == layout.expected, (layout, usable)


@pytest.fixture(scope="module")
def runner():
    torch.set_num_threads(1)
    model = engine.load_model("tiny")
    with tempfile.TemporaryDirectory(prefix="tidekv-hitrule-") as tmp:
        store = TieredStore(StoreConfig(model.fingerprint, dram_capacity_bytes=64 << 20,
                                        ssd_capacity_bytes=64 << 20, ssd_dir=f"{tmp}/ssd", ssd_fsync=False))
        hub = TransferHub(TransferConfig())
        try:
            yield PrefillRunner(model, store, hub, model.new_cache(64, 2, BS), 4)
        finally:
            hub.close()
            store.close()


def test_the_prefill_runner_reuses_what_the_hit_rule_allows(runner) -> None:
    fp = runner.model.fingerprint
    gen = torch.Generator().manual_seed(0)
    kda = tuple(runner.model.cfg.kda_layer_ids)
    for i, layout in enumerate(layouts(2, (Tier.DRAM, Tier.SSD))):
        tokens, keys = prompt_keys(i, len(layout.tiers), fp)
        for key, tier, snap in zip(keys, layout.tiers, layout.snapshots, strict=True):
            if tier is not None:
                payload = make_random_payload(gen, model_fingerprint=fp, kda_layer_ids=kda if snap else ())
                assert runner.store.put(key, payload, tier)
        call = PrefillCall(f"r{i}", tuple(tokens), SamplingParams(max_new_tokens=1), keys, len(keys),
                           "tcp://127.0.0.1:1", 30.0)
        reuse = Reuse()
        runner._plan_reuse(call, reuse)
        assert reuse.num_blocks == layout.expected, (layout, reuse.num_blocks)


def test_the_simulated_prefill_worker_reuses_what_the_hit_rule_allows() -> None:
    config = PrefillConfig(block_size=BS, device_bytes=1 << 30, dram_bytes=1 << 30, ssd_bytes=1 << 30)
    costs = CostModels.analytic(prefill_s_per_token=1e-4, decode_base_s=0.01)
    worker = SimPrefill("prefill-0", config, costs, ClusterState(ttl_s=1e9), EventLoop(), {}, on_done=lambda job: None)
    for i, layout in enumerate(layouts(3, (Tier.DEVICE, Tier.DRAM, Tier.SSD))):
        tokens, keys = prompt_keys(i, len(layout.tiers), "simulated")
        for key, tier, snap in zip(keys, layout.tiers, layout.snapshots, strict=True):
            if tier is not None:
                worker.store.put(key, SizedBlob(1024, snap), snap, tier)
        job = SimPrefillJob(f"r{i}", len(tokens), BS, keys, len(keys), None)
        worker._reuse(job)
        assert job.num_reused_tokens == layout.expected * BS, (layout, job.num_reused_tokens)
