"""Chunked pipeline parallelism end to end, real processes: a prefill instance of 2 stages
(``--cpp-stages 2``: two processes, each with half of the layers) and a decode instance. A
16k-token prompt is pipelined through the stages (the Conductor's cost-model threshold
chooses it; the instance's log says it did), its KV streamed layerwise to the decode worker,
and the completion is token-exact against ``engine.generate``; the blocks it stored (the second
stage's KDA state gathered into them) serve a longer prompt, token-exact again; a short prompt
passes the stages in one chunk. A small random model keeps this within a minute on 2 cores."""

from __future__ import annotations

import dataclasses

import pytest

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from engine.checkpoint import save_checkpoint, seeded_tensors
from engine.config import tiny_config
from tests.e2e.helpers import prompt, run_all, wait_all_freed

pytestmark = pytest.mark.timeout(300)
BLOCK = 32
LONG = 16_384
SMALL = dataclasses.replace(
    tiny_config(), hidden_size=128, num_hidden_layers=4, mla_layer_ids=(1, 3), kda_layer_ids=(0, 2),
    intermediate_size=256, num_attention_heads=2, kda_num_heads=2, kda_head_dim=32, kv_lora_rank=64,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=4, num_experts_per_token=2,
    moe_intermediate_size=64, vocab_size=512, max_seq_len=20_000, name="cpp-small")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cpp-small")
    save_checkpoint(path, SMALL, seeded_tensors(SMALL, seed=3, std=0.05))
    return path


def test_a_16k_prompt_pipelined_over_two_stages_is_token_exact(model_dir):
    reference = engine.load_model(str(model_dir))
    worker = ("--block-size", str(BLOCK), "--snapshot-interval-blocks", "64")
    config = ClusterConfig(
        num_prefill=1, num_decode=1, model=str(model_dir), conductor_args=("--max-prompt-tokens", "19000"),
        prefill_args=(*worker, "--num-pages", "1200", "--cpp-stages", "2", "--cpp-chunk-tokens", "1024"),
        decode_args=("--block-size", str(BLOCK), "--num-pages", "1300"))
    with LocalCluster(config) as cluster:
        (info,) = [w for w in cluster.workers().workers if w.worker_id == "prefill-0"]
        assert (info.cpp_stages, info.cpp_chunk_tokens) == (2, 1024)
        long_ids = prompt(LONG, 17)
        out = run_all(cluster.endpoint, [Client.request(long_ids, max_tokens=8)])[0]
        assert out.finish_reason == "length", out.error
        assert out.token_ids == engine.generate(reference, long_ids, 8)
        log = (cluster.log_dir / "prefill-0.log").read_text()
        assert f"{LONG} tokens pipelined in chunks of 1024 over 2 stages" in log

        # The stored blocks (canonical: every layer's rows, both stages' KDA state) are reused.
        longer = long_ids + prompt(300, 18)
        out = run_all(cluster.endpoint, [Client.request(longer, max_tokens=8)])[0]
        assert out.cached_tokens >= LONG - 1024, out
        assert out.token_ids == engine.generate(reference, longer, 8)

        short = prompt(400, 19)
        out = run_all(cluster.endpoint, [Client.request(short, max_tokens=8)])[0]
        assert out.token_ids == engine.generate(reference, short, 8)
        assert "400 tokens in one chunk over 2 stages" in (cluster.log_dir / "prefill-0.log").read_text()
        wait_all_freed(cluster)
