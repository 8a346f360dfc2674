"""DeepSeek-V3/K2 checkpoints: config.json as the K2 family ships it, the wrappers and forms it
comes in, and clear errors naming the key, file and tensor for bad ones."""

import json

import pytest
import torch

import engine
from engine.checkpoint import CheckpointError, expected_shapes, save_checkpoint, seeded_tensors
from engine.config import ModelConfig, tiny_k2_config

# Kimi-K2-Instruct's public config.json (the keys the engine reads, values as shipped).
K2_INSTRUCT = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "bos_token_id": 163584,
    "eos_token_id": 163585, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 131072,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 163840,
}  # fmt: skip


def test_k2_instruct_config_reads_as_shipped():
    cfg = ModelConfig.from_dict(K2_INSTRUCT)
    assert cfg.architecture == "deepseek_v3" and cfg.kda_layer_ids == () and len(cfg.mla_layer_ids) == 61
    assert (cfg.q_lora_rank, cfg.num_experts, cfg.num_experts_per_token, cfg.num_expert_group) == (1536, 384, 8, 1)
    assert cfg.rope.yarn_factor == 32.0 and cfg.rope.interleave and cfg.rope.rotated_value_factor == 1.0
    layout = cfg.cache_layout
    assert not layout.has_state and layout.latent_dim == 576
    assert len(layout.mla_layer_ids) * layout.latent_dim * 2 / 1024 == pytest.approx(68.6, abs=0.05)  # bf16 KiB/token
    # kimi_k2 and transformers 5's rope_parameters form read the same.
    v5 = {k: v for k, v in K2_INSTRUCT.items() if k not in ("rope_scaling", "rope_theta")}
    v5.update(model_type="deepseek_v3", rope_parameters={**K2_INSTRUCT["rope_scaling"], "rope_type": "yarn",
                                                         "rope_theta": 50000.0})
    assert ModelConfig.from_dict(v5) == cfg
    # Written back and read again: the same config.
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "llama"}, r"model_type must be one of \[.*'deepseek_v3'.*\], got 'llama'"),
    ({"architectures": ["KimiLinearForCausalLM"]}, r"architectures \['KimiLinearForCausalLM'\] disagree with "
                                                   r"model_type 'kimi_k2'"),
    ({"scoring_func": "softmax"}, r"scoring_func must be one of \['sigmoid'\], got 'softmax'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling.type 'linear' is not supported"),
    ({"num_key_value_heads": 8}, r"num_key_value_heads=8 must equal num_attention_heads=64"),
    ({"n_routed_experts": None}, r"n_routed_experts must be set"),
    ({"n_group": 7}, r"num_experts=384 not divisible by num_expert_group=7"),
    ({"qk_nope_head_dim": None}, r"missing required key qk_nope_head_dim"),
])  # fmt: skip
def test_unsupported_or_bad_config_names_the_key(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**K2_INSTRUCT, **change})


def test_moe_layer_freq_places_dense_layers():
    import dataclasses

    cfg = dataclasses.replace(tiny_k2_config(), moe_layer_freq=2)
    shapes = expected_shapes(cfg)
    moe = [i for i in range(4) if f"model.layers.{i}.mlp.gate.weight" in shapes]
    dense = [i for i in range(4) if f"model.layers.{i}.mlp.gate_proj.weight" in shapes]
    assert moe == [2] and dense == [0, 1, 3]
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in shapes


def _k25_directory(d, cfg, tensors):
    """A K2.5-style checkpoint: the text model wrapped with a vision part the engine does not use."""
    d.mkdir()
    text = {**cfg.to_dict(), "model_type": "kimi_k2"}
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": text, "vision_config": {"hidden_size": 8}}
    (d / "config.json").write_text(json.dumps(wrapper))
    from safetensors.torch import save_file

    named = {f"language_model.{n}": t for n, t in tensors.items()}
    named["vision_tower.patch_embed.weight"] = torch.zeros(8, 3)
    named["mm_projector.proj.0.weight"] = torch.zeros(8, 8)
    save_file(named, str(d / "model.safetensors"))


def test_k25_wrapper_and_mtp_layers_load_the_text_model(tmp_path):
    cfg = tiny_k2_config()
    tensors = seeded_tensors(cfg, 5)
    save_checkpoint(tmp_path / "bare", cfg, tensors)
    bare = engine.load_model(str(tmp_path / "bare"))
    _k25_directory(tmp_path / "k25", cfg, tensors)
    wrapped = engine.load_model(str(tmp_path / "k25"))
    assert wrapped.cfg.tensor_prefix == "language_model." and wrapped.fingerprint == bare.fingerprint
    # A multi-token-prediction layer after the last one (DeepSeek-V3 ships layer 61) is not read.
    import dataclasses

    mtp_cfg = dataclasses.replace(cfg, num_nextn_predict_layers=1)
    mtp = dict(tensors, **{"model.layers.4.eh_proj.weight": torch.zeros(4, 4)})
    save_checkpoint(tmp_path / "mtp", mtp_cfg, mtp, num_shards=2)
    with_mtp = engine.load_model(str(tmp_path / "mtp"))
    ids = list(range(3, 60))
    want = engine.prompt_logits(bare, ids)
    assert torch.equal(engine.prompt_logits(wrapped, ids), want)
    assert torch.equal(engine.prompt_logits(with_mtp, ids), want)


@pytest.fixture
def sharded(tmp_path):
    cfg = tiny_k2_config()
    tensors = seeded_tensors(cfg, 3)
    return tmp_path, cfg, tensors


def _index(d):
    return json.loads((d / "model.safetensors.index.json").read_text())


def test_missing_tensor_names_it_and_the_directory(sharded):
    d, cfg, t = sharded
    del t["model.layers.2.self_attn.q_a_layernorm.weight"]
    save_checkpoint(d, cfg, t, num_shards=3)
    with pytest.raises(CheckpointError, match=rf"{d}: checkpoint is missing tensor "
                                              r"model\.layers\.2\.self_attn\.q_a_layernorm\.weight"):
        engine.load_model(str(d))


def test_wrong_shape_names_the_shard_and_the_tensor(sharded):
    d, cfg, t = sharded
    name = "model.layers.3.mlp.experts.5.up_proj.weight"
    t[name] = torch.zeros(128, 256)
    save_checkpoint(d, cfg, t, num_shards=3)
    shard = _index(d)["weight_map"][name]
    with pytest.raises(CheckpointError, match=rf"{shard}: tensor {name} has shape \[128, 256\], "
                                              r"config expects \[256, 256\]"):
        engine.load_model(str(d))


def test_unexpected_tensor_names_its_file(sharded):
    d, cfg, t = sharded
    t["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(4, 4)  # q_lora models have no q_proj
    save_checkpoint(d, cfg, t, num_shards=2)
    shard = _index(d)["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    with pytest.raises(CheckpointError, match=rf"{shard}: checkpoint has unexpected tensor "
                                              r"model\.layers\.1\.self_attn\.q_proj\.weight"):
        engine.load_model(str(d))


def test_index_naming_a_missing_file_or_tensor(sharded):
    d, cfg, t = sharded
    save_checkpoint(d, cfg, t, num_shards=2)
    index = _index(d)
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"index\.json: lists model-00009-of-00009\.safetensors, which is not"):
        engine.load_model(str(d))
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    index["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors: tensor model\.extra\.weight is "
                                              r"listed in model\.safetensors\.index\.json but not in the file"):
        engine.load_model(str(d))
    (d / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    with pytest.raises(CheckpointError, match=r"index\.json: malformed index"):
        engine.load_model(str(d))
