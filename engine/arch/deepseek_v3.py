"""DeepSeek-V3's ``config.json`` (``model_type`` ``deepseek_v3`` or ``kimi_k2``): the K2 family.

Owns reading its keys into a ``ModelConfig`` (every layer MLA with decoupled RoPE, no KDA
state) and writing them back as K2 ships them. Keys that are absent take the defaults of the
reference (transformers' ``DeepseekV3Config``), so a config reads the same here and there;
``q_lora_rank: null`` means a plain ``q_proj``. Settings the engine does not implement (another
scoring function or top-k method, attention biases, grouped key/value heads, an activation
other than SiLU, a rope type other than YaRN) are refused, naming the key.
"""

from __future__ import annotations

from typing import Any

from engine.arch.keys import expect, require
from engine.config import DEEPSEEK_V3, ModelConfig
from engine.rope import RopeConfig

# The reference's defaults for keys a config.json may leave out.
_DEFAULTS = {
    "q_lora_rank": 1536, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "moe_layer_freq": 1, "rope_interleave": True, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
}  # fmt: skip


def from_dict(raw: dict[str, Any], name: str = "custom", where: str = "") -> ModelConfig:
    """ValueError naming the key (``where`` prefixes it: ``text_config.`` inside a wrapper)."""
    _refuse_unsupported(raw, where)

    def get(key: str) -> Any:
        return raw[key] if key in raw else _DEFAULTS[key]

    def req(key: str) -> Any:
        return require(raw, key, where)

    layers = int(req("num_hidden_layers"))
    heads = int(req("num_attention_heads"))
    kv_heads = raw.get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != heads:
        raise ValueError(f"config.json: {where}num_key_value_heads={kv_heads} must equal num_attention_heads={heads} "
                         "(MLA expands one latent into every head)")
    eos = raw.get("eos_token_id")
    q_lora = raw["q_lora_rank"] if "q_lora_rank" in raw else _DEFAULTS["q_lora_rank"]
    return ModelConfig(
        vocab_size=int(req("vocab_size")),
        hidden_size=int(req("hidden_size")),
        num_hidden_layers=layers,
        intermediate_size=int(req("intermediate_size")),
        num_attention_heads=heads,
        kv_lora_rank=int(req("kv_lora_rank")),
        qk_nope_head_dim=int(req("qk_nope_head_dim")),
        qk_rope_head_dim=int(req("qk_rope_head_dim")),
        v_head_dim=int(req("v_head_dim")),
        num_experts=int(req("n_routed_experts")),
        num_experts_per_token=int(req("num_experts_per_tok")),
        moe_intermediate_size=int(req("moe_intermediate_size")),
        kda_num_heads=0,
        kda_head_dim=0,
        mla_layer_ids=tuple(range(layers)),
        kda_layer_ids=(),
        first_k_dense_replace=int(get("first_k_dense_replace")),
        num_shared_experts=int(get("n_shared_experts")),
        routed_scaling_factor=float(get("routed_scaling_factor")),
        moe_renormalize=bool(get("norm_topk_prob")),
        num_expert_group=int(get("n_group") or 1),
        topk_group=int(get("topk_group") or 1),
        rms_norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        max_seq_len=int(get("max_position_embeddings")),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        name=name,
        architecture=DEEPSEEK_V3,
        q_lora_rank=None if q_lora is None else int(q_lora),
        rope=_rope(raw, where, bool(get("rope_interleave")), int(get("max_position_embeddings"))),
        moe_layer_freq=int(get("moe_layer_freq")),
        num_nextn_predict_layers=int(get("num_nextn_predict_layers") or 0),
    )


def _refuse_unsupported(raw: dict[str, Any], where: str) -> None:
    expect(raw, "hidden_act", ("silu",), where)
    expect(raw, "scoring_func", ("sigmoid",), where)
    expect(raw, "topk_method", ("noaux_tc",), where)
    expect(raw, "attention_bias", (False,), where)
    expect(raw, "mlp_bias", (False,), where)
    if "n_routed_experts" in raw and raw["n_routed_experts"] is None:
        raise ValueError(f"config.json: {where}n_routed_experts must be set (a dense DeepSeek model is not supported)")


def _rope(raw: dict[str, Any], where: str, interleave: bool, max_positions: int) -> RopeConfig:
    """RoPE from ``rope_scaling`` (as K2 ships it) or ``rope_parameters`` (transformers 5), with
    ``rope_theta`` at the top level or inside."""
    key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json: {where}{key} must be an object or null, got {params!r}")
    theta = float(params.get("rope_theta", raw.get("rope_theta", _DEFAULTS["rope_theta"])))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta, interleave=interleave)
    if kind != "yarn":
        raise ValueError(f"config.json: {where}{key}.type {kind!r} is not supported (use 'yarn', or no scaling)")
    original = int(params.get("original_max_position_embeddings") or max_positions)
    factor = params.get("factor")
    return RopeConfig(
        theta=theta, interleave=interleave,
        yarn_factor=float(factor) if factor is not None else max_positions / original,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
        truncate=bool(params.get("truncate", True)),
    )


def to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` K2 ships (``model_type`` written as ``deepseek_v3``, which readers know)."""
    d: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "n_shared_experts": cfg.num_shared_experts, "n_routed_experts": cfg.num_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor, "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "n_group": cfg.num_expert_group, "topk_group": cfg.topk_group,
        "num_experts_per_tok": cfg.num_experts_per_token, "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": cfg.moe_layer_freq, "norm_topk_prob": cfg.moe_renormalize, "hidden_act": "silu",
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "attention_bias": False,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        # Only the embedding's padding row depends on it; readers insist it lies in the vocabulary.
        "pad_token_id": cfg.eos_token_id if cfg.eos_token_id is not None else 0,
    }  # fmt: skip
    rope = cfg.rope
    assert rope is not None, "a DeepSeek-V3 model always rotates its rope dims"
    d.update(rope_theta=rope.theta, rope_interleave=rope.interleave, rope_scaling=None)
    if rope.yarn_factor is not None:
        scaling: dict[str, Any] = {
            "type": "yarn", "factor": rope.yarn_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
            "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow,
        }
        scaling.update({k: v for k, v in (("mscale", rope.mscale), ("mscale_all_dim", rope.mscale_all_dim)) if v})
        if rope.attention_factor is not None:
            scaling["attention_factor"] = rope.attention_factor
        if not rope.truncate:
            scaling["truncate"] = False
        d["rope_scaling"] = scaling
    return d
