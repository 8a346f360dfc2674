"""Checkpoint schema, seeded initialisation and safetensors loading, in the original names.

Owns the single description of every tensor a checkpoint holds (``expected_shapes``, in the
names of the config's architecture: Kimi-Linear's or DeepSeek-V3's), so that a seeded built-in
model, a loaded directory and a written test checkpoint all agree. Each linear layer enters
the schema through ``add_linear`` by its name prefix. Loading is all-or-nothing: a missing,
unexpected or mis-shaped tensor raises ``CheckpointError`` naming it and its file before any
model is built.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from engine.arch import tensor_names
from engine.config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint directory that does not match its config."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint (original naming) mapped to its shape."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        add_linear(shapes, "lm_head", cfg.vocab_size, h)
    names = tensor_names(cfg)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.is_mla(i):
            _mla_shapes(shapes, cfg, p + "self_attn.")
        else:
            _kda_shapes(shapes, cfg, p + "self_attn.")
        if cfg.is_moe(i):
            m = p + names.moe
            e_i = cfg.moe_intermediate_size
            shapes[m + "gate.weight"] = (cfg.num_experts, h)
            shapes[m + "gate.e_score_correction_bias"] = (cfg.num_experts,)
            for e in range(cfg.num_experts):
                add_linear(shapes, m + f"experts.{e}.{names.expert_gate}", e_i, h)
                add_linear(shapes, m + f"experts.{e}.{names.expert_down}", h, e_i)
                add_linear(shapes, m + f"experts.{e}.{names.expert_up}", e_i, h)
            _mlp_shapes(shapes, m + "shared_experts.", e_i * cfg.num_shared_experts, h)
        else:
            _mlp_shapes(shapes, p + "mlp.", cfg.intermediate_size, h)
    return shapes


def add_linear(shapes: dict[str, tuple[int, ...]], prefix: str, out_features: int, in_features: int) -> None:
    """The tensors of one linear layer named ``prefix`` (its ``[out, in]`` weight): the one place
    a linear layer enters the schema, so a packed format can describe its own tensors here."""
    shapes[prefix + ".weight"] = (out_features, in_features)


def _mlp_shapes(shapes: dict[str, tuple[int, ...]], prefix: str, inner: int, h: int) -> None:
    add_linear(shapes, prefix + "gate_proj", inner, h)
    add_linear(shapes, prefix + "up_proj", inner, h)
    add_linear(shapes, prefix + "down_proj", h, inner)


def _mla_shapes(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, a: str) -> None:
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        add_linear(shapes, a + "q_proj", nh * cfg.qk_head_dim, h)
    else:
        add_linear(shapes, a + "q_a_proj", cfg.q_lora_rank, h)
        shapes[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        add_linear(shapes, a + "q_b_proj", nh * cfg.qk_head_dim, cfg.q_lora_rank)
    add_linear(shapes, a + "kv_a_proj_with_mqa", cfg.latent_dim, h)
    shapes[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    add_linear(shapes, a + "kv_b_proj", nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    add_linear(shapes, a + "o_proj", h, nh * cfg.v_head_dim)


def _kda_shapes(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, a: str) -> None:
    h, hd, d = cfg.hidden_size, cfg.kda_head_dim, cfg.kda_dim
    for n in ("q_proj", "k_proj", "v_proj"):
        add_linear(shapes, a + n, d, h)
    for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
        shapes[a + n + ".weight"] = (d, 1, cfg.conv_kernel_size)
    add_linear(shapes, a + "o_proj", h, d)
    shapes[a + "A_log"] = (1, 1, cfg.kda_num_heads, 1)
    shapes[a + "dt_bias"] = (d,)
    add_linear(shapes, a + "f_a_proj", hd, h)
    add_linear(shapes, a + "f_b_proj", d, hd)
    add_linear(shapes, a + "b_proj", cfg.kda_num_heads, h)
    add_linear(shapes, a + "g_a_proj", hd, h)
    add_linear(shapes, a + "g_b_proj", d, hd)
    shapes[a + "o_norm.weight"] = (hd,)


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
    """Reads the model's tensors from a checkpoint directory (``model.safetensors``, or the shards
    ``model.safetensors.index.json`` lists) and checks names and shapes against ``cfg``.
    With a ``quantization_config`` in config.json, each quantized linear is one
    ``engine.quant.PackedWeight`` under its ``.weight`` name (``engine/quant/loader.py``).

    Names are the checkpoint's own, less ``cfg.tensor_prefix``; tensors outside it (a wrapper's
    vision parts) and multi-token-prediction layers are not read. Errors name the file and the
    tensor."""
    directory = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    for fname, listed in _checkpoint_files(directory).items():
        for name, t in _read_file(directory / fname, cfg, listed).items():
            if name in tensors:
                raise CheckpointError(f"{directory / fname}: tensor {name} is also in {sources[name]}")
            tensors[name], sources[name] = t, str(directory / fname)
    from engine.quant import load_quant_config

    qcfg = load_quant_config(directory)
    if qcfg is not None:  # quantized linears become engine.quant.PackedWeight, checked by name and shape
        from engine.quant.loader import take_packed

        tensors = take_packed(tensors, sources, qcfg, expected_shapes(cfg), cfg.tensor_prefix)
    check_tensors(tensors, cfg, sources, where=str(directory))
    return tensors


def _checkpoint_files(directory: Path) -> dict[str, set[str] | None]:
    """The safetensors files to read, each with the tensor names the index puts in it (None for
    a single-file checkpoint)."""
    index_path = directory / "model.safetensors.index.json"
    if index_path.exists():
        files: dict[str, set[str]] = {}
        try:
            for name, fname in json.loads(index_path.read_text())["weight_map"].items():
                files.setdefault(str(fname), set()).add(str(name))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index_path}: malformed index ({e!r})") from e
        for fname in files:
            if not (directory / fname).is_file():
                raise CheckpointError(f"{index_path}: lists {fname}, which is not in {directory}")
        return {fname: files[fname] for fname in sorted(files)}
    if (directory / "model.safetensors").exists():
        return {"model.safetensors": None}
    raise CheckpointError(f"{directory}: no model.safetensors nor model.safetensors.index.json")


def _read_file(path: Path, cfg: ModelConfig, listed: set[str] | None) -> dict[str, torch.Tensor]:
    """The model's tensors in one file, by model name (prefix stripped)."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            missing = sorted((listed or set()) - names)
            if missing:
                raise CheckpointError(f"{path}: tensor {missing[0]} is listed in model.safetensors.index.json "
                                      f"but not in the file ({len(missing)} such)")
            for name in sorted(names):
                model_name = _model_name(name, cfg)
                if model_name is not None:
                    out[model_name] = f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from e
    return out


def _model_name(name: str, cfg: ModelConfig) -> str | None:
    """The name a checkpoint tensor has in the model, or None for one the engine does not use."""
    if cfg.tensor_prefix:
        if not name.startswith(cfg.tensor_prefix):
            return None  # a wrapper's other parts (K2.5's vision tower and projector)
        name = name[len(cfg.tensor_prefix):]
    if cfg.num_nextn_predict_layers and name.startswith("model.layers."):
        layer = name.split(".", 3)[2]
        if layer.isdigit() and int(layer) >= cfg.num_hidden_layers:
            return None  # a multi-token-prediction layer (DeepSeek-V3 ships one as layer 61)
    return name


def check_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, sources: dict[str, str] | None = None,
                  where: str = "checkpoint") -> None:
    """Raises CheckpointError naming the first missing, unexpected or mis-shaped tensor (and the
    file it came from, with ``sources``)."""
    sources = sources or {}
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{where}: checkpoint is missing tensor {cfg.tensor_prefix}{missing[0]} (expected "
                              f"shape {list(expected[missing[0]])}); {len(missing)} missing in all")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        name = unexpected[0]
        raise CheckpointError(f"{sources.get(name, where)}: checkpoint has unexpected tensor {cfg.tensor_prefix}{name} "
                              f"(shape {list(tensors[name].shape)}); {len(unexpected)} unexpected in all")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"{sources.get(name, where)}: tensor {cfg.tensor_prefix}{name} has shape "
                                  f"{list(tensors[name].shape)}, config expects {list(shape)}")
