"""Architectures the engine serves, chosen by ``config.json`` (``model_type``, ``architectures``).

Owns the choice and the per-architecture parts that are not compute: reading ``config.json``
into a ``ModelConfig`` and writing it back (``kimi_linear.py``, ``deepseek_v3.py``), and the
checkpoint's tensor names that differ between them (``TensorNames``). The compute follows the
config's fields alone.

    model_type                      architectures                       architecture
    kimi_linear (or absent)         KimiLinearForCausalLM               kimi_linear
    deepseek_v3, kimi_k2            DeepseekV3ForCausalLM               deepseek_v3
    kimi_k25 (text_config: either)  KimiK25ForConditionalGeneration     deepseek_v3, tensors under
                                                                        "language_model." (vision parts unused)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.arch import deepseek_v3, kimi_linear
from engine.config import DEEPSEEK_V3, KIMI_LINEAR, ModelConfig

_BY_MODEL_TYPE = {"kimi_linear": KIMI_LINEAR, "deepseek_v3": DEEPSEEK_V3, "kimi_k2": DEEPSEEK_V3}
_BY_ARCHITECTURES = {"KimiLinearForCausalLM": KIMI_LINEAR, "DeepseekV3ForCausalLM": DEEPSEEK_V3}
_WRAPPERS = {"kimi_k25": ("KimiK25ForConditionalGeneration", "language_model.")}
_READERS = {KIMI_LINEAR: kimi_linear, DEEPSEEK_V3: deepseek_v3}


@dataclass(frozen=True)
class TensorNames:
    """The checkpoint names that differ between architectures (the rest are shared)."""

    moe: str  # the MoE block under each layer: "<moe>gate.weight", "<moe>experts.E.<gate>.weight", ...
    expert_gate: str
    expert_up: str
    expert_down: str


_NAMES = {
    KIMI_LINEAR: TensorNames("block_sparse_moe.", "w1", "w3", "w2"),
    DEEPSEEK_V3: TensorNames("mlp.", "gate_proj", "up_proj", "down_proj"),
}


def tensor_names(cfg: ModelConfig) -> TensorNames:
    return _NAMES[cfg.architecture]


def config_from_dict(raw: dict[str, Any], name: str = "custom") -> ModelConfig:
    """The ``ModelConfig`` of a ``config.json``; ValueError naming the key that is missing,
    unsupported or inconsistent."""
    model_type = raw.get("model_type")
    if model_type in _WRAPPERS:
        return _wrapped(raw, model_type, name)
    arch = _architecture(raw, "")
    return _READERS[arch].from_dict(raw, name)


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of ``cfg``'s architecture (a wrapped text model is written bare)."""
    return _READERS[cfg.architecture].to_dict(cfg)


def _architecture(raw: dict[str, Any], where: str) -> str:
    model_type = raw.get("model_type")
    declared = raw.get("architectures") or []
    if not isinstance(declared, list):
        raise ValueError(f"config.json: {where}architectures must be a list, got {declared!r}")
    by_declared = {_BY_ARCHITECTURES[a] for a in declared if a in _BY_ARCHITECTURES}
    if model_type is None:
        if len(by_declared) > 1:
            raise ValueError(f"config.json: {where}architectures {declared} name more than one architecture")
        return by_declared.pop() if by_declared else KIMI_LINEAR
    if model_type not in _BY_MODEL_TYPE:
        known = sorted([*_BY_MODEL_TYPE, *_WRAPPERS])
        raise ValueError(f"config.json: {where}model_type must be one of {known}, got {model_type!r}")
    arch = _BY_MODEL_TYPE[model_type]
    if by_declared - {arch}:
        raise ValueError(f"config.json: {where}architectures {declared} disagree with model_type {model_type!r}")
    return arch


def _wrapped(raw: dict[str, Any], model_type: str, name: str) -> ModelConfig:
    """A multimodal wrapper (K2.5): its ``text_config`` is the served model."""
    _, prefix = _WRAPPERS[model_type]
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config.json: model_type {model_type!r} needs a text_config object")
    text = {"model_type": "deepseek_v3", **text}
    arch = _architecture(text, "text_config.")
    if arch != DEEPSEEK_V3:
        raise ValueError(f"config.json: text_config.model_type of {model_type!r} must be deepseek_v3 or kimi_k2, "
                         f"got {text.get('model_type')!r}")
    cfg = deepseek_v3.from_dict(text, name, where="text_config.")
    return replace(cfg, tensor_prefix=prefix)
