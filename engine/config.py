"""Model configuration: the Hugging Face ``config.json`` of a Kimi-Linear model, frozen.

Owns parsing and validation of the config keys listed in the reference page, the layer map
(taken from ``linear_attn_config``, never from a fixed period) and the built-in ``tiny``
configuration that every process builds identically from a seed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TINY_SEED = 20251130


@dataclass(frozen=True)
class ModelConfig:
    """One Kimi-Linear hybrid. Layer ids here are 0-based; ``linear_attn_config`` is 1-based."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    kda_num_heads: int
    kda_head_dim: int
    mla_layer_ids: tuple[int, ...]
    kda_layer_ids: tuple[int, ...]
    first_k_dense_replace: int = 1
    num_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    conv_kernel_size: int = 4
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_seq_len: int = 8192
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = "custom"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        layers = set(range(self.num_hidden_layers))
        given = list(self.mla_layer_ids) + list(self.kda_layer_ids)
        if sorted(given) != sorted(layers):
            raise ValueError(
                f"linear_attn_config: full_attn_layers + kda_layers must cover layers 1..{self.num_hidden_layers} "
                f"exactly once, got full={[i + 1 for i in self.mla_layer_ids]} "
                f"kda={[i + 1 for i in self.kda_layer_ids]}"
            )
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"num_experts_per_token={self.num_experts_per_token} exceeds num_experts={self.num_experts}"
            )
        if self.num_experts % self.num_expert_group:
            raise ValueError(
                f"num_experts={self.num_experts} not divisible by num_expert_group={self.num_expert_group}"
            )

    # ---- derived values -------------------------------------------------------------------
    @property
    def latent_dim(self) -> int:
        """Values cached per token per MLA layer: the normalised latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def conv_window_len(self) -> int:
        return self.conv_kernel_size - 1

    @property
    def conv_channels(self) -> int:
        """Channels of the short-conv window: q, k and v side by side."""
        return 3 * self.kda_dim

    def is_mla(self, layer_id: int) -> bool:
        return layer_id in self.mla_layer_ids

    def is_moe(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    # ---- (de)serialisation ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "custom") -> ModelConfig:
        """Reads the keys of a ``config.json``; raises ValueError naming a missing or bad key."""
        if raw.get("model_type") not in (None, "kimi_linear"):
            raise ValueError(f"config.json: model_type must be 'kimi_linear', got {raw.get('model_type')!r}")
        if raw.get("q_lora_rank") is not None:
            raise ValueError(f"config.json: q_lora_rank must be null for Kimi-Linear, got {raw['q_lora_rank']}")
        if raw.get("mla_use_nope", True) is not True:
            raise ValueError("config.json: mla_use_nope=false (rotary MLA) is not supported")
        lac = _require(raw, "linear_attn_config")
        full = [int(i) - 1 for i in _require(lac, "full_attn_layers", "linear_attn_config.")]
        kda = [int(i) - 1 for i in _require(lac, "kda_layers", "linear_attn_config.")]
        eos = raw.get("eos_token_id")
        return cls(
            vocab_size=int(_require(raw, "vocab_size")),
            hidden_size=int(_require(raw, "hidden_size")),
            num_hidden_layers=int(_require(raw, "num_hidden_layers")),
            intermediate_size=int(_require(raw, "intermediate_size")),
            num_attention_heads=int(_require(raw, "num_attention_heads")),
            kv_lora_rank=int(_require(raw, "kv_lora_rank")),
            qk_nope_head_dim=int(_require(raw, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_require(raw, "qk_rope_head_dim")),
            v_head_dim=int(_require(raw, "v_head_dim")),
            num_experts=int(_require(raw, "num_experts")),
            num_experts_per_token=int(_require(raw, "num_experts_per_token")),
            moe_intermediate_size=int(_require(raw, "moe_intermediate_size")),
            kda_num_heads=int(_require(lac, "num_heads", "linear_attn_config.")),
            kda_head_dim=int(_require(lac, "head_dim", "linear_attn_config.")),
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
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` form (1-based layer lists, original key names)."""
        d = asdict(self)
        for k in ("mla_layer_ids", "kda_layer_ids", "kda_num_heads", "kda_head_dim", "conv_kernel_size",
                  "max_seq_len", "name", "extra"):
            d.pop(k)
        d.update(
            model_type="kimi_linear",
            q_lora_rank=None,
            mla_use_nope=True,
            model_max_length=self.max_seq_len,
            # Only the embedding's padding row depends on it; readers insist it lies in the vocabulary.
            pad_token_id=self.eos_token_id if self.eos_token_id is not None else 0,
            linear_attn_config={
                "head_dim": self.kda_head_dim,
                "num_heads": self.kda_num_heads,
                "short_conv_kernel_size": self.conv_kernel_size,
                "full_attn_layers": [i + 1 for i in self.mla_layer_ids],
                "kda_layers": [i + 1 for i in self.kda_layer_ids],
            },
        )
        return d

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(raw, name=path.parent.name)


def _require(d: dict[str, Any], key: str, prefix: str = "") -> Any:
    if key not in d or d[key] is None:
        raise ValueError(f"config.json: missing required key {prefix}{key}")
    return d[key]


def tiny_config() -> ModelConfig:
    """The built-in model: 6 layers (MLA at 3 and 6, 1-based), ~16M parameters, byte vocabulary."""
    return ModelConfig(
        vocab_size=8192,
        hidden_size=256,
        num_hidden_layers=6,
        intermediate_size=768,
        num_attention_heads=4,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=256,
        kda_num_heads=4,
        kda_head_dim=64,
        mla_layer_ids=(2, 5),
        kda_layer_ids=(0, 1, 3, 4),
        routed_scaling_factor=2.5,
        max_seq_len=8192,
        bos_token_id=256,
        eos_token_id=257,
        name="tiny",
    )
