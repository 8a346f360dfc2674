"""The Kimi-Linear hybrid engine (KDA + MLA + MoE) with a paged MLA cache and KDA state slots.

Public API (stable; other packages use only these):
``load_model``, ``load_config``, ``load_tokenizer``, ``prompt_logits``, ``generate``,
``export_prefix``/``import_prefix``
(``CacheExport``), ``SamplingParams``/``sample``, ``HybridModel``, ``CacheManager``,
``SequenceCache``, ``ModelConfig``, ``CheckpointError``.
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
from engine.config import ModelConfig, tiny_config
from engine.model import HybridModel
from engine.sampler import SamplingParams, sample

__all__ = [
    "DEFAULT_BLOCK_SIZE", "CacheExport", "CacheManager", "CheckpointError", "HybridModel", "ModelConfig",
    "SamplingParams", "SequenceCache", "check_prompt", "export_prefix", "generate", "import_prefix",
    "load_config", "load_model", "load_tokenizer", "prompt_logits", "sample", "tiny_config",
]
