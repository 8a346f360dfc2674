"""The Mooncake scheduler on live clusters (real processes): a hot prefix spreads by pulling
(replication) where cache_aware piles onto the holder, and an overload is answered with fast
SLO-based rejections while the admitted requests stay token-exact."""

from __future__ import annotations

import threading
from collections import Counter

import grpc
import pytest

import engine
from conductor.client import Client, Completion
from tests.e2e.conftest import make_cluster
from tests.e2e.helpers import prompt, run_all, wait_all_freed

HOT = prompt(256, 900)  # 16 blocks of 16 tokens: a shared system prompt


def hot_burst(policy: str, reference) -> tuple[str, list[Completion]]:
    """Seeds the hot prefix on one worker, then sends 5 requests sharing it at once."""
    with make_cluster(2, 1, policy=policy) as c:
        seed = run_all(c.endpoint, [Client.request(HOT + prompt(40, 901), max_tokens=2)])[0]
        holder = seed.prefill_worker
        prompts = [HOT + prompt(48, 910 + i) for i in range(5)]
        outs = run_all(c.endpoint, [Client.request(p, max_tokens=6) for p in prompts], max_workers=5)
        for p, out in zip(prompts, outs, strict=True):
            assert out.num_terminal == 1 and out.finish_reason == "length", out.error
            assert out.token_ids == engine.generate(reference, p, 6)
        wait_all_freed(c)
    return holder, outs


def test_mooncake_replicates_a_hot_prefix_where_cache_aware_piles_on_the_holder(reference):
    holder, outs = hot_burst("mooncake", reference)
    on_other = [o for o in outs if o.prefill_worker != holder]
    assert on_other, f"every request went to the holder {holder}: {[o.route_branch for o in outs]}"
    assert all(o.pulled_from == holder and o.route_branch in ("pull", "replicate") for o in on_other[:1])
    assert all(o.cached_tokens == 256 for o in outs)  # on the holder or pulled from it

    holder, outs = hot_burst("cache_aware", reference)
    assert Counter(o.prefill_worker for o in outs) == {holder: 5}
    assert all(o.route_branch == "local" and o.cached_tokens == 256 for o in outs)


def test_overload_is_rejected_early_by_predicted_ttft_and_the_admitted_stay_exact(reference):
    with make_cluster(1, 1, conductor_args=("--max-running", "32")) as c:
        prompts = [prompt(400, 950 + i) for i in range(12)]
        results: list[Completion | grpc.RpcError | None] = [None] * len(prompts)
        client = Client(c.endpoint)

        def one(i: int) -> None:
            try:
                results[i] = client.generate(Client.request(prompts[i], max_tokens=5, ttft_slo_s=1.5), timeout_s=120)
            except grpc.RpcError as e:
                results[i] = e

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        client.close()
        refused = [r for r in results if isinstance(r, grpc.RpcError)]
        done = [(i, r) for i, r in enumerate(results) if isinstance(r, Completion)]
        assert len(refused) + len(done) == len(prompts)
        assert refused and done, (len(refused), len(done))
        for r in refused:
            assert r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "misses the 1.5s SLO" in r.details()
            assert dict(r.trailing_metadata())["reject-reason"] == "ttft_slo"
            assert float(dict(r.trailing_metadata())["retry-after-s"]) > 0
        for i, r in done:
            assert r.num_terminal == 1 and r.finish_reason == "length"
            assert r.token_ids == engine.generate(reference, prompts[i], 5)
            assert 0 < r.predicted_ttft_s <= 1.5
            t = r.timing  # the prediction's parts, as the terminal message reports them
            parts = t.predicted_dispatch_s + t.predicted_queue_s + t.predicted_transfer_s + t.predicted_prefill_s
            assert parts == pytest.approx(t.predicted_ttft_s) and t.predicted_slowdown > 0
        wait_all_freed(c)
