"""The engine: Kimi Linear (KDA + MLA + MoE) and DeepSeek-V3/K2 (MLA with RoPE + DeepSeek MoE)
with a paged MLA cache and KDA state slots.

Public API (stable; other packages use only these):
``load_model``, ``load_config``, ``load_tokenizer``, ``prompt_logits``, ``generate``,
``export_prefix``/``import_prefix``
(``CacheExport``), ``SamplingParams``/``sample``, ``HybridModel``, ``CacheManager``,
``SequenceCache``, ``ModelConfig`` (its ``cache_layout``: ``CacheLayout``), ``CheckpointError``,
``BUILTIN_MODELS`` (the names ``load_model`` builds from a seed).
A checkpoint's experts may be quantized as the family ships them (INT4, MXFP4: ``engine.quant``);
its tokenizer may be Kimi's ``tiktoken.model`` (``engine.tiktoken_tokenizer``).

The names load on first use (``engine.X`` imports X's module then), so a package that needs
only a frozen value from here (a block size, ``SamplingParams``) does not pay for torch:
the simulator and ``tidekv simulate`` never import it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module that defines it
_SOURCES = {
    "DEFAULT_BLOCK_SIZE": "engine.layout", "CacheLayout": "engine.layout",
    "CacheExport": "engine.api", "check_prompt": "engine.api", "export_prefix": "engine.api",
    "generate": "engine.api", "import_prefix": "engine.api", "load_config": "engine.api",
    "load_model": "engine.api", "load_tokenizer": "engine.api", "prompt_logits": "engine.api",
    "CacheManager": "engine.cache", "SequenceCache": "engine.cache",
    "CheckpointError": "engine.checkpoint",
    "ModelConfig": "engine.config", "tiny_config": "engine.config", "tiny_k2_config": "engine.config",
    "HybridModel": "engine.model",
    "SamplingParams": "engine.sampling_params", "sample": "engine.sampler",
}

__all__ = [
    "BUILTIN_MODELS", "DEFAULT_BLOCK_SIZE", "CacheExport", "CacheLayout", "CacheManager", "CheckpointError",
    "HybridModel", "ModelConfig", "SamplingParams", "SequenceCache", "check_prompt", "export_prefix", "generate",
    "import_prefix", "load_config", "load_model", "load_tokenizer", "prompt_logits", "sample", "tiny_config",
    "tiny_k2_config",
]


def __getattr__(name: str) -> Any:
    if name == "BUILTIN_MODELS":
        from engine.config import BUILTIN_CONFIGS

        value: Any = tuple(BUILTIN_CONFIGS)
    elif name in _SOURCES:
        value = getattr(importlib.import_module(_SOURCES[name]), name)
    else:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from engine.api import (
        CacheExport,
        check_prompt,
        export_prefix,
        generate,
        import_prefix,
        load_config,
        load_model,
        load_tokenizer,
        prompt_logits,
    )
    from engine.cache import CacheManager, SequenceCache
    from engine.checkpoint import CheckpointError
    from engine.config import ModelConfig, tiny_config, tiny_k2_config
    from engine.layout import DEFAULT_BLOCK_SIZE, CacheLayout
    from engine.model import HybridModel
    from engine.sampler import sample
    from engine.sampling_params import SamplingParams

    BUILTIN_MODELS: tuple[str, ...]
