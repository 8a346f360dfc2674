"""Parity of the DeepSeek-V3/K2 architecture with transformers' DeepseekV3ForCausalLM (pure PyTorch).

Random configs of our own cover each choice the reference makes: a low-rank query or a plain
q_proj, YaRN (K2's mscale 1/1, and a ratio other than 1) or plain RoPE, interleaved rope dims or
halves, group-limited routing or one group, shared experts and dense layers, renormalised or raw
top-k weights.
"""

import dataclasses

import pytest
import torch

import engine
from engine.checkpoint import save_checkpoint, seeded_tensors
from engine.config import tiny_k2_config
from engine.rope import RopeConfig

transformers = pytest.importorskip("transformers")

K2 = tiny_k2_config()
PLAIN_ROPE = RopeConfig(theta=10000.0, interleave=True)
YARN_RATIO = RopeConfig(theta=20000.0, interleave=False, yarn_factor=4.0, original_max_position_embeddings=64,
                        beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=1.0)
CONFIGS = {
    # q_lora, YaRN as K2 sets it (factor 32, beta 1/1, mscale 1/1), one group: the built-in tiny-k2.
    "k2": K2,
    # plain q_proj, plain RoPE, group-limited routing (4 groups, 2 kept), top-3 of 8.
    "no-lora-grouped": dataclasses.replace(
        K2, q_lora_rank=None, rope=PLAIN_ROPE, num_expert_group=4, topk_group=2, num_experts_per_token=3,
        name="no-lora-grouped"),
    # q_lora, YaRN with mscale != mscale_all_dim and halves (not interleaved), 3 layers, 2 dense, 2 shared,
    # raw top-k weights, other head sizes, 2 groups of 3.
    "yarn-ratio": dataclasses.replace(
        K2, num_hidden_layers=3, mla_layer_ids=(0, 1, 2), rope=YARN_RATIO, first_k_dense_replace=2,
        num_shared_experts=2, moe_renormalize=False, num_attention_heads=2, qk_nope_head_dim=48,
        qk_rope_head_dim=16, v_head_dim=40, kv_lora_rank=64, q_lora_rank=48, num_experts=6,
        num_expert_group=2, topk_group=1, vocab_size=4096, name="yarn-ratio"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prompt_logits_match_transformers(name, tmp_path):
    cfg = CONFIGS[name]
    save_checkpoint(tmp_path, cfg, seeded_tensors(cfg, seed=7), num_shards=1 if name == "k2" else 3)
    ours = engine.load_model(str(tmp_path))
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert ref.model.layers[0].self_attn.scaling == pytest.approx(ours.blocks[0].attn.scale, rel=1e-12)
    ids = torch.randint(0, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    got = engine.prompt_logits(ours, ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    assert got.shape == want.shape == (300, cfg.vocab_size)
    assert (got - want).abs().max().item() < 1e-4
    # The check can fail: a shifted position breaks it.
    assert (got[1:] - want[:-1]).abs().max().item() > 1e-2


def test_group_limited_routing_changes_choices():
    """The grouped config's routing really differs from ungrouped top-k (else the parity above
    would not cover the group limit)."""
    model = engine.load_model("tiny-k2")
    moe = model.blocks[1].ffn
    x = torch.randn(256, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    ungrouped, _ = moe.route(x)
    moe.groups, moe.topk_group, moe.top_k = 4, 2, 3
    grouped, _ = moe.route(x)
    moe.groups, moe.topk_group = 1, 1
    top3, _ = moe.route(x)
    moe.groups, moe.topk_group, moe.top_k = 1, 1, 2
    assert ungrouped.shape == (256, 2)
    assert (grouped.sort(-1).values != top3.sort(-1).values).any(-1).sum() > 10
    experts_per_group = model.cfg.num_experts // 4
    for row in (grouped // experts_per_group).tolist():
        assert len(set(row)) <= 2  # chosen experts lie in the 2 kept groups


def test_yarn_frequencies_and_scales_match_transformers():
    """The rotary tables themselves (frequencies, the rotated-value factor, the softmax scale)."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rope in (K2.rope, YARN_RATIO):
        params = {"rope_type": "yarn", "rope_theta": rope.theta, "factor": rope.yarn_factor,
                  "original_max_position_embeddings": rope.original_max_position_embeddings,
                  "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow, "mscale": rope.mscale,
                  "mscale_all_dim": rope.mscale_all_dim}
        hf = DeepseekV3Config(qk_rope_head_dim=32, rope_parameters=params, max_position_embeddings=8192)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
        assert torch.allclose(rope.inv_freq(32), inv_freq, rtol=1e-6, atol=0)
        assert rope.rotated_value_factor == pytest.approx(factor)
    assert YARN_RATIO.rotated_value_factor != pytest.approx(1.0)
    assert K2.rope.softmax_scale_factor == pytest.approx((0.1 * torch.log(torch.tensor(32.0)).item() + 1) ** 2)
