"""The engine's public API: loading, the single-process reference, and cache export/import.

``generate`` here is the reference the cluster must match token for token: prefill computes
all N prompt tokens and samples token N+1 at position N; decode continues from there, one
token per step, with the sampler seeded by (seed, position).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cache import CacheManager, SequenceCache
from engine.checkpoint import CheckpointError, load_tensors, seeded_tensors
from engine.config import BUILTIN_CONFIGS, TINY_SEED, ModelConfig
from engine.layout import DEFAULT_BLOCK_SIZE
from engine.model import HybridModel
from engine.parallel.comm import LOCAL, Comm
from engine.parallel.shard import SINGLE_PLAN, ShardPlan
from engine.quant import PackedWeight
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.tiktoken_tokenizer import RANKS_FILE, TiktokenTokenizer
from engine.tokenizer import CharTokenizer, HFTokenizer


def load_model(path_or_name: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
               plan: ShardPlan = SINGLE_PLAN, comm: Comm = LOCAL, layers: range | None = None) -> HybridModel:
    """A built-in model by name (``"tiny"``: Kimi Linear, ``"tiny-k2"``: DeepSeek-V3/K2; seeded
    weights) or a checkpoint directory with config.json + safetensors (architecture chosen by
    its ``model_type`` / ``architectures``).

    ``plan``/``comm``/``layers``: one rank's share of a parallel instance (``engine.parallel``);
    the fingerprint is the whole model's whatever the share.

    Raises CheckpointError / ValueError naming the offending key or tensor; nothing is built
    until every tensor has been checked. On CPU this turns on flush-to-zero for denormals
    (process-wide): decaying KDA states otherwise slow a step 10-100x.
    """
    if device == "cpu":
        torch.set_flush_denormal(True)
    if path_or_name in BUILTIN_CONFIGS:
        cfg = BUILTIN_CONFIGS[path_or_name]()
        tensors = seeded_tensors(cfg, TINY_SEED)
        fingerprint = _fingerprint(cfg, tensors, extra=f"tiny-seed-{TINY_SEED}")
        tokenizer = CharTokenizer(cfg.vocab_size)
    else:
        cfg = load_config(path_or_name)
        tensors = load_tensors(Path(path_or_name), cfg)
        fingerprint = _fingerprint(cfg, tensors)
        tokenizer = load_tokenizer(path_or_name)
    model = HybridModel(cfg, tensors, fingerprint, device=device, dtype=dtype, plan=plan, comm=comm, layers=layers)
    model.tokenizer = tokenizer
    return model


def load_config(path_or_name: str) -> ModelConfig:
    """The config alone (no weights): what a Conductor needs to validate and tokenize."""
    if path_or_name in BUILTIN_CONFIGS:
        return BUILTIN_CONFIGS[path_or_name]()
    path = Path(path_or_name) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path_or_name!r} is neither 'tiny' nor a directory with config.json "
                              f"(built-in models: {', '.join(BUILTIN_CONFIGS)})")
    return ModelConfig.from_file(path)


def load_tokenizer(path_or_name: str) -> CharTokenizer | HFTokenizer | TiktokenTokenizer:
    """A checkpoint's ``tiktoken.model`` (+ ``tokenizer_config.json``: Kimi's), else its
    ``tokenizer.json``, else (and for built-in models) one token per character."""
    cfg = load_config(path_or_name)
    if path_or_name in BUILTIN_CONFIGS:
        return CharTokenizer(cfg.vocab_size)
    directory = Path(path_or_name)
    if (directory / RANKS_FILE).exists():
        tok = TiktokenTokenizer(directory, cfg.eos_token_id)
        if tok.vocab_size > cfg.vocab_size:
            raise CheckpointError(f"{directory / RANKS_FILE}: the tokenizer has {tok.vocab_size} ids (ranks and "
                                  f"special tokens), more than config.json's vocab_size {cfg.vocab_size}")
        return tok
    if (directory / "tokenizer.json").exists():
        return HFTokenizer(directory / "tokenizer.json", cfg.eos_token_id)
    return CharTokenizer(cfg.vocab_size)


def _fingerprint(cfg: ModelConfig, tensors: dict[str, torch.Tensor], extra: str = "") -> str:
    """Stable id of (config, weights): names, shapes and a sample of every tensor's values."""
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps(cfg.to_dict(), sort_keys=True).encode() + extra.encode())
    for name in sorted(tensors):
        t = tensors[name]
        if isinstance(t, PackedWeight):  # a quantized linear: its format, codes and scales
            h.update(f"{name}:{list(t.shape)}:{t.format}/{t.group_size}".encode())
            h.update(t.fingerprint_sample().numpy().tobytes())
            continue
        h.update(f"{name}:{list(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1)[:64].float().numpy().tobytes())
    return h.hexdigest()


def check_prompt(model: HybridModel, prompt_ids: Sequence[int], max_new_tokens: int = 0) -> None:
    """Raises ValueError naming the field and limit for an unusable prompt."""
    cfg = model.cfg
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids must not be empty")
    if len(prompt_ids) + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt length {len(prompt_ids)} + max_new_tokens {max_new_tokens} exceeds "
                         f"the model's maximum sequence length {cfg.max_seq_len}")
    bad = next((t for t in prompt_ids if not 0 <= int(t) < cfg.vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt_ids: token id {bad} outside the vocabulary [0, {cfg.vocab_size})")


def _single_cache(model: HybridModel, num_tokens: int, block_size: int) -> tuple[CacheManager, SequenceCache]:
    pages = -(-num_tokens // block_size)
    cache = model.new_cache(num_pages=max(pages, 1), num_slots=1, block_size=block_size)
    seq = cache.try_reserve("reference", num_tokens)
    assert seq is not None
    return cache, seq


@torch.inference_mode()
def prompt_logits(model: HybridModel, prompt_ids: list[int], chunk_tokens: int | None = None) -> torch.Tensor:
    """Logits [len(prompt_ids), vocab] (float32) from the chunked prefill path the servers use."""
    check_prompt(model, prompt_ids)
    cache, seq = _single_cache(model, len(prompt_ids), DEFAULT_BLOCK_SIZE)
    return model.prefill(cache, seq, prompt_ids, all_logits=True, chunk_tokens=chunk_tokens)


@torch.inference_mode()
def generate(
    model: HybridModel, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
    top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop_token_ids: Sequence[int] = (),
) -> list[int]:
    """The single-process reference: the new token ids (a stop token, if hit, is included)."""
    params = SamplingParams(max_new_tokens, temperature, top_p, top_k, seed, tuple(stop_token_ids))
    params.validate(model.cfg.vocab_size)
    check_prompt(model, prompt_ids, max_new_tokens)
    cache, seq = _single_cache(model, len(prompt_ids) + max_new_tokens, DEFAULT_BLOCK_SIZE)
    logits = model.prefill(cache, seq, prompt_ids)
    out = [sample(logits, [params], [len(prompt_ids)])[0]]
    while len(out) < max_new_tokens and out[-1] not in params.stop_token_ids:
        logits = model.decode_step(cache, [seq], [out[-1]])
        out.append(sample(logits, [params], [seq.num_tokens])[0])
    return out


@dataclass(frozen=True)
class CacheExport:
    """A request's cache at a block boundary ``num_tokens`` (a multiple of block_size).

    Layout (dtype of the pool for mla, float32 for the KDA parts)::

        mla        [num_mla_layers, num_tokens, latent_dim]    rows of tokens [0, num_tokens)
        kda_state  [num_kda_layers, H, D, D]                   recurrent state after num_tokens
        kda_conv   [num_kda_layers, K-1, 3*H*D]                conv window after num_tokens
    """

    num_tokens: int
    mla: torch.Tensor
    kda_state: torch.Tensor
    kda_conv: torch.Tensor


def export_prefix(cache: CacheManager, seq: SequenceCache, num_tokens: int) -> CacheExport:
    """Copies seq's cache for tokens [0, num_tokens). The KDA state must exist at that point:
    either the current one (num_tokens == seq.num_tokens) or a snapshot taken in prefill (a
    model without KDA layers has none to keep: any block boundary works)."""
    if num_tokens % cache.block_size or not 0 < num_tokens <= seq.num_tokens:
        raise ValueError(f"export at {num_tokens}: must be a positive multiple of block_size "
                         f"{cache.block_size} and at most the {seq.num_tokens} cached tokens")
    if num_tokens == seq.num_tokens or not cache.cfg.cache_layout.has_state:
        # Without state layers the (empty) state is the same at every boundary.
        state, conv = cache.slots.state[:, seq.slot].clone(), cache.slots.conv[:, seq.slot].clone()
    elif num_tokens in seq.snapshots:
        state, conv = (t.clone() for t in seq.snapshots[num_tokens])
    else:
        raise ValueError(f"no KDA state at token {num_tokens}: snapshots exist at {sorted(seq.snapshots)}")
    mla = torch.stack([cache.rows(seq, i, 0, num_tokens) for i in range(cache.pool.kv.shape[0])])
    return CacheExport(num_tokens, mla, state, conv)


def import_prefix(cache: CacheManager, seq: SequenceCache, export: CacheExport) -> None:
    """Loads an export into a fresh seq (with pages for at least export.num_tokens)."""
    if seq.num_tokens != 0:
        raise ValueError(f"import into request {seq.request_id} that already holds {seq.num_tokens} tokens")
    if export.num_tokens > len(seq.pages) * cache.block_size:
        raise ValueError(f"import of {export.num_tokens} tokens into {len(seq.pages)} pages")
    expected = (cache.pool.kv.shape[0], export.num_tokens, cache.pool.kv.shape[-1])
    if tuple(export.mla.shape) != expected:
        raise ValueError(f"export mla shape {list(export.mla.shape)}, cache expects {list(expected)}")
    for i in range(expected[0]):
        cache.write_rows(seq, i, 0, export.mla[i])
    cache.slots.state[:, seq.slot] = export.kda_state
    cache.slots.conv[:, seq.slot] = export.kda_conv
    seq.num_tokens = export.num_tokens
