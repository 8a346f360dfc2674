"""Model configuration: one frozen ``ModelConfig`` for every architecture the engine serves.

Owns the fields (architecture-neutral names), their validation, the derived values (the layer
map, the cache layout each model declares) and the built-in configurations (``tiny``, a
Kimi-Linear hybrid, and ``tiny-k2``, a DeepSeek-V3/K2 model) that every process builds
identically from a seed. Reading and writing ``config.json`` per architecture lives in
``engine.arch``; ``ModelConfig.from_dict`` / ``to_dict`` dispatch there.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.layout import CacheLayout
from engine.rope import RopeConfig

TINY_SEED = 20251130
KIMI_LINEAR = "kimi_linear"
DEEPSEEK_V3 = "deepseek_v3"


@dataclass(frozen=True)
class ModelConfig:
    """One model. Layer ids here are 0-based (Kimi-Linear's ``linear_attn_config`` is 1-based).

    ``architecture`` (``kimi_linear`` or ``deepseek_v3``) picks the checkpoint's tensor names and
    the ``config.json`` form; the compute follows the fields alone (a model without KDA layers
    has no recurrent state, a model with ``rope`` rotates its MLA rope dims).
    """

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
    architecture: str = KIMI_LINEAR
    q_lora_rank: int | None = None
    rope: RopeConfig | None = None  # None: no rotary embedding (Kimi-Linear's mla_use_nope)
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers a checkpoint may carry; unused
    tensor_prefix: str = ""  # where the text model's tensors live in the checkpoint (K2.5: "language_model.")

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
        if not 1 <= self.topk_group <= self.num_expert_group:
            raise ValueError(f"topk_group={self.topk_group} must lie in [1, num_expert_group={self.num_expert_group}]")
        if self.num_expert_group > 1 and self.num_experts // self.num_expert_group < 2:
            raise ValueError(f"group-limited routing scores each group by its top 2 experts: num_experts="
                             f"{self.num_experts} / num_expert_group={self.num_expert_group} leaves fewer")
        if self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq must be at least 1, got {self.moe_layer_freq}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be positive or null, got {self.q_lora_rank}")

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

    @property
    def cache_layout(self) -> CacheLayout:
        """What this model caches per request (see ``engine.layout``)."""
        return CacheLayout(
            mla_layer_ids=self.mla_layer_ids, latent_dim=self.latent_dim, rope_dim=self.qk_rope_head_dim,
            state_layer_ids=self.kda_layer_ids,
            state_shape=(self.kda_num_heads, self.kda_head_dim, self.kda_head_dim) if self.kda_layer_ids else (),
            conv_shape=(self.conv_window_len, self.conv_channels) if self.kda_layer_ids else (),
        )

    def is_mla(self, layer_id: int) -> bool:
        return layer_id in self.mla_layer_ids

    def is_moe(self, layer_id: int) -> bool:
        """DeepSeek's rule: MoE from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer."""
        return layer_id >= self.first_k_dense_replace and layer_id % self.moe_layer_freq == 0

    # ---- (de)serialisation ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "custom") -> ModelConfig:
        """Reads a ``config.json`` of any supported architecture (chosen by ``model_type`` and
        ``architectures``); raises ValueError naming a missing or bad key."""
        from engine.arch import config_from_dict

        return config_from_dict(raw, name)

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` form of this model's architecture (original key names)."""
        from engine.arch import config_to_dict

        return config_to_dict(self)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: must hold a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, name=path.parent.name)


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


def tiny_k2_config() -> ModelConfig:
    """The built-in K2-architecture model (DeepSeek-V3: MLA with decoupled RoPE, DeepSeek MoE):
    K2's choices (q_lora, YaRN with mscale 1/1 at factor 32, one shared expert, a dense first
    layer, scaling 2.827, rope_theta 50000) at a size that decodes fast on two CPU cores:
    4 layers, hidden 256, 8 experts of 256, ~13M parameters, byte vocabulary: the tiny model's
    sizes otherwise."""
    return dataclasses.replace(
        tiny_config(),
        num_hidden_layers=4,
        kda_num_heads=0,
        kda_head_dim=0,
        mla_layer_ids=(0, 1, 2, 3),
        kda_layer_ids=(),
        routed_scaling_factor=2.827,
        rms_norm_eps=1e-6,
        name="tiny-k2",
        architecture=DEEPSEEK_V3,
        q_lora_rank=96,
        rope=RopeConfig(theta=50000.0, interleave=True, yarn_factor=32.0, original_max_position_embeddings=256,
                        beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    )


BUILTIN_CONFIGS = {"tiny": tiny_config, "tiny-k2": tiny_k2_config}
"""The built-in models by name: seeded weights (``TINY_SEED``), byte tokenizer."""
