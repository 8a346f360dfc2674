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
"""

from engine.api import (
    DEFAULT_BLOCK_SIZE,
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
from engine.config import BUILTIN_CONFIGS, ModelConfig, tiny_config, tiny_k2_config
from engine.layout import CacheLayout
from engine.model import HybridModel
from engine.sampler import SamplingParams, sample

BUILTIN_MODELS = tuple(BUILTIN_CONFIGS)

__all__ = [
    "BUILTIN_MODELS", "DEFAULT_BLOCK_SIZE", "CacheExport", "CacheLayout", "CacheManager", "CheckpointError",
    "HybridModel", "ModelConfig", "SamplingParams", "SequenceCache", "check_prompt", "export_prefix", "generate",
    "import_prefix", "load_config", "load_model", "load_tokenizer", "prompt_logits", "sample", "tiny_config",
    "tiny_k2_config",
]
