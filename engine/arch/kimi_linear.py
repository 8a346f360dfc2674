"""Kimi Linear's ``config.json`` (``model_type: kimi_linear``): the KDA + MLA (NoPE) hybrid.

Owns reading its keys (the layer map from ``linear_attn_config``, never from a fixed period)
and writing them back in the original names.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from engine.arch.keys import require
from engine.config import KIMI_LINEAR, ModelConfig

# ModelConfig fields this form does not write (derived, fixed for the architecture, or local).
_NOT_WRITTEN = ("mla_layer_ids", "kda_layer_ids", "kda_num_heads", "kda_head_dim", "conv_kernel_size", "max_seq_len",
                "name", "extra", "architecture", "q_lora_rank", "rope", "moe_layer_freq", "num_nextn_predict_layers",
                "tensor_prefix")


def from_dict(raw: dict[str, Any], name: str = "custom") -> ModelConfig:
    if raw.get("q_lora_rank") is not None:
        raise ValueError(f"config.json: q_lora_rank must be null for Kimi-Linear, got {raw['q_lora_rank']}")
    if raw.get("mla_use_nope", True) is not True:
        raise ValueError("config.json: mla_use_nope=false (rotary MLA) is not supported")
    lac = require(raw, "linear_attn_config")
    full = [int(i) - 1 for i in require(lac, "full_attn_layers", "linear_attn_config.")]
    kda = [int(i) - 1 for i in require(lac, "kda_layers", "linear_attn_config.")]
    eos = raw.get("eos_token_id")
    return ModelConfig(
        vocab_size=int(require(raw, "vocab_size")),
        hidden_size=int(require(raw, "hidden_size")),
        num_hidden_layers=int(require(raw, "num_hidden_layers")),
        intermediate_size=int(require(raw, "intermediate_size")),
        num_attention_heads=int(require(raw, "num_attention_heads")),
        kv_lora_rank=int(require(raw, "kv_lora_rank")),
        qk_nope_head_dim=int(require(raw, "qk_nope_head_dim")),
        qk_rope_head_dim=int(require(raw, "qk_rope_head_dim")),
        v_head_dim=int(require(raw, "v_head_dim")),
        num_experts=int(require(raw, "num_experts")),
        num_experts_per_token=int(require(raw, "num_experts_per_token")),
        moe_intermediate_size=int(require(raw, "moe_intermediate_size")),
        kda_num_heads=int(require(lac, "num_heads", "linear_attn_config.")),
        kda_head_dim=int(require(lac, "head_dim", "linear_attn_config.")),
        mla_layer_ids=tuple(sorted(full)),
        kda_layer_ids=tuple(sorted(kda)),
        first_k_dense_replace=int(raw.get("first_k_dense_replace", 1)),
        num_shared_experts=int(raw.get("num_shared_experts", 1)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        moe_renormalize=bool(raw.get("moe_renormalize", True)),
        num_expert_group=int(raw.get("num_expert_group", 1) or 1),
        topk_group=int(raw.get("topk_group", 1) or 1),
        conv_kernel_size=int(lac.get("short_conv_kernel_size", 4)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_seq_len=int(raw.get("model_max_length", raw.get("max_position_embeddings", 8192))),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        name=name,
        architecture=KIMI_LINEAR,
    )


def to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` form (1-based layer lists, original key names)."""
    d = asdict(cfg)
    for k in _NOT_WRITTEN:
        d.pop(k)
    d.update(
        model_type="kimi_linear",
        q_lora_rank=None,
        mla_use_nope=True,
        model_max_length=cfg.max_seq_len,
        # Only the embedding's padding row depends on it; readers insist it lies in the vocabulary.
        pad_token_id=cfg.eos_token_id if cfg.eos_token_id is not None else 0,
        linear_attn_config={
            "head_dim": cfg.kda_head_dim,
            "num_heads": cfg.kda_num_heads,
            "short_conv_kernel_size": cfg.conv_kernel_size,
            "full_attn_layers": [i + 1 for i in cfg.mla_layer_ids],
            "kda_layers": [i + 1 for i in cfg.kda_layer_ids],
        },
    )
    return d
