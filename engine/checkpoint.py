"""Checkpoint schema, seeded initialisation and safetensors loading, in the original names.

Owns the single description of every tensor a Kimi-Linear checkpoint holds
(``expected_shapes``), so that a seeded ``tiny`` model, a loaded directory and a written
test checkpoint all agree. Loading is all-or-nothing: a missing, unexpected or mis-shaped
tensor raises ``CheckpointError`` naming it before any model is built.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from engine.config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint directory that does not match its config."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint (original naming) mapped to its shape."""
    h, hd = cfg.hidden_size, cfg.kda_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        a = p + "self_attn."
        if cfg.is_mla(i):
            nh = cfg.num_attention_heads
            shapes[a + "q_proj.weight"] = (nh * cfg.qk_head_dim, h)
            shapes[a + "kv_a_proj_with_mqa.weight"] = (cfg.latent_dim, h)
            shapes[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
            shapes[a + "kv_b_proj.weight"] = (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
            shapes[a + "o_proj.weight"] = (h, nh * cfg.v_head_dim)
        else:
            d = cfg.kda_dim
            for n in ("q_proj", "k_proj", "v_proj"):
                shapes[a + n + ".weight"] = (d, h)
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                shapes[a + n + ".weight"] = (d, 1, cfg.conv_kernel_size)
            shapes[a + "o_proj.weight"] = (h, d)
            shapes[a + "A_log"] = (1, 1, cfg.kda_num_heads, 1)
            shapes[a + "dt_bias"] = (d,)
            shapes[a + "f_a_proj.weight"] = (hd, h)
            shapes[a + "f_b_proj.weight"] = (d, hd)
            shapes[a + "b_proj.weight"] = (cfg.kda_num_heads, h)
            shapes[a + "g_a_proj.weight"] = (hd, h)
            shapes[a + "g_b_proj.weight"] = (d, hd)
            shapes[a + "o_norm.weight"] = (hd,)
        if cfg.is_moe(i):
            m = p + "block_sparse_moe."
            e_i = cfg.moe_intermediate_size
            shapes[m + "gate.weight"] = (cfg.num_experts, h)
            shapes[m + "gate.e_score_correction_bias"] = (cfg.num_experts,)
            for e in range(cfg.num_experts):
                shapes[m + f"experts.{e}.w1.weight"] = (e_i, h)
                shapes[m + f"experts.{e}.w2.weight"] = (h, e_i)
                shapes[m + f"experts.{e}.w3.weight"] = (e_i, h)
            s_i = e_i * cfg.num_shared_experts
            shapes[m + "shared_experts.gate_proj.weight"] = (s_i, h)
            shapes[m + "shared_experts.up_proj.weight"] = (s_i, h)
            shapes[m + "shared_experts.down_proj.weight"] = (h, s_i)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    return shapes


def seeded_tensors(cfg: ModelConfig, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights: the same on every process and machine for one seed."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in sorted(expected_shapes(cfg).items()):
        out[name] = _init_one(name, shape, gen, std)
    return out


def _init_one(name: str, shape: tuple[int, ...], gen: torch.Generator, std: float) -> torch.Tensor:
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight") or leaf.endswith("norm"):
        # Norm weights near one, perturbed so a wrong norm placement shows in parity tests.
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if leaf == "A_log":
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if leaf == "dt_bias":
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp().clamp_min(1e-4)
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if leaf == "e_score_correction_bias":
        return 0.05 * torch.randn(shape, generator=gen)
    if name.endswith("conv1d.weight"):
        return 0.3 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    return std * torch.randn(shape, generator=gen)


def save_checkpoint(
    directory: str | Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], num_shards: int = 1
) -> None:
    """Writes ``config.json`` and safetensors (one file, or shards with an index)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    names = sorted(tensors)
    if num_shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(directory / "model.safetensors"))
        return
    weight_map: dict[str, str] = {}
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[s::num_shards]
        save_file({n: tensors[n].contiguous() for n in part}, str(directory / fname))
        weight_map.update({n: fname for n in part})
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def load_tensors(directory: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Reads every tensor of a checkpoint directory and checks names and shapes against ``cfg``.

    With a ``quantization_config`` in config.json, each quantized linear is one
    ``engine.quant.PackedWeight`` under its ``.weight`` name (``engine/quant/loader.py``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    index_path = directory / "model.safetensors.index.json"
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index_path}: malformed index ({e})") from e
        files = sorted(set(weight_map.values()))
    elif (directory / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{directory}: no model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for fname in files:
        try:
            part = load_file(str(directory / fname))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{directory / fname}: cannot read safetensors file ({e})") from e
        tensors.update(part)
        origin.update(dict.fromkeys(part, str(directory / fname)))
    from engine.quant import load_quant_config

    qcfg = load_quant_config(directory)
    if qcfg is not None:  # quantized linears become engine.quant.PackedWeight, checked by name and shape
        from engine.quant.loader import take_packed

        tensors = take_packed(tensors, origin, qcfg, expected_shapes(cfg))
    check_tensors(tensors, cfg)
    return tensors


def check_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Raises CheckpointError naming the first missing, unexpected or mis-shaped tensor."""
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]} (expected shape "
                              f"{list(expected[missing[0]])}); {len(missing)} missing in all")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"checkpoint has unexpected tensor {unexpected[0]} "
                              f"(shape {list(tensors[unexpected[0]].shape)}); {len(unexpected)} unexpected in all")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"tensor {name} has shape {list(tensors[name].shape)}, config expects {list(shape)}"
            )
