"""Parity with an independent implementation: transformers' KimiLinearForCausalLM (pure PyTorch)."""

import dataclasses

import pytest
import torch

import engine
from engine.checkpoint import save_checkpoint, seeded_tensors
from engine.config import tiny_config

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "tiny": tiny_config(),
    # Different layer map (MLA first and last, two KDA in a row), heads, experts, top-k, groups.
    "other": dataclasses.replace(
        tiny_config(), num_hidden_layers=5, mla_layer_ids=(0, 4), kda_layer_ids=(1, 2, 3),
        num_attention_heads=2, kda_num_heads=2, kda_head_dim=32, num_experts=6, num_experts_per_token=3,
        num_expert_group=2, topk_group=1, first_k_dense_replace=2, num_shared_experts=2,
        kv_lora_rank=64, qk_rope_head_dim=16, routed_scaling_factor=1.7, vocab_size=4096, name="other",
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prompt_logits_match_transformers(name, tmp_path):
    cfg = CONFIGS[name]
    save_checkpoint(tmp_path, cfg, seeded_tensors(cfg, seed=7), num_shards=1 if name == "tiny" else 3)
    ours = engine.load_model(str(tmp_path))
    ref = transformers.KimiLinearForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (333,), generator=torch.Generator().manual_seed(1)).tolist()
    got = engine.prompt_logits(ours, ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    assert got.shape == want.shape == (333, cfg.vocab_size)
    assert (got - want).abs().max().item() < 1e-4
    # The check can fail: a perturbed layer breaks it.
    assert (got[1:] - want[:-1]).abs().max().item() > 1e-2
