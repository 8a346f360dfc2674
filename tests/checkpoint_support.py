"""Checkpoint directories as the Kimi family ships them, written by the tests themselves:
quantized safetensors with ``quantization_config`` (through compressed-tensors) and Kimi's
tokenizer files (a BPE rank file trained here on a small corpus: no downloaded encodings)."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

import torch

from engine.checkpoint import expected_shapes, save_checkpoint, seeded_tensors
from engine.config import ModelConfig
from engine.quant import reference

CORPUS = (
    "The prefill worker computes the prompt's keys and values layer by layer and streams them to the decode "
    "worker, which samples one token per step. Kimi K2 is a mixture of experts; its routed experts ship in "
    "INT4. 缓存命中时，预填充只计算新的词元。 Numbers like 12345 and 2048 split in threes. "
    "It's the block size that decides what a prefix hit can reuse, isn't it? Yes: whole blocks only.\n"
)
SPECIAL = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")
# A Kimi-style chat template (role markers are special tokens, each turn ends with <|im_end|>).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def train_ranks(corpus: str = CORPUS, num_merges: int = 300) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pair merged, again
    and again (within whitespace-led words, as a BPE trainer does)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(tuple(bytes([b]) for b in w.encode()) for w in _words(corpus))
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:], strict=False):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        words = Counter({_merge(w, a, b): n for w, n in words.items()})
    return ranks


def _words(text: str) -> list[str]:
    out, cur = [], ""
    for ch in text:
        if ch.isspace() and cur and not cur.isspace():
            out.append(cur)
            cur = ""
        cur += ch
    return [*out, cur] if cur else out


def _merge(word: tuple[bytes, ...], a: bytes, b: bytes) -> tuple[bytes, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def write_tiktoken_tokenizer(directory: str | Path, ranks: dict[bytes, int], eos: str = "<|im_end|>") -> int:
    """Writes ``tiktoken.model`` and ``tokenizer_config.json`` (special tokens right after the
    ranks, the chat template); returns the tokenizer's vocabulary size (ranks + 256 specials)."""
    directory = Path(directory)
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    decoder = {str(base + i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                               "normalized": False, "single_word": False} for i, t in enumerate(SPECIAL)}
    config = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": eos, "chat_template": CHAT_TEMPLATE,
              "tokenizer_class": "TikTokenTokenizer", "model_max_length": 8192}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return base + 256


def write_quantized_checkpoint(directory: str | Path, cfg: ModelConfig, fmt: str, seed: int = 7,
                               ignore: tuple[str, ...] = reference.EXPERTS_ONLY, num_shards: int = 1,
                               tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """config.json with ``quantization_config`` + safetensors of seeded weights quantized by
    compressed-tensors (``fmt``: engine.quant.INT4 or MXFP4); returns the checkpoint's tensors."""
    qconfig = reference.quantization_config(fmt, ignore)
    if tensors is None:
        tensors = reference.quantize(seeded_tensors(cfg, seed), qconfig, expected_shapes(cfg))
    save_checkpoint(directory, cfg, tensors, num_shards=num_shards)
    reference.write_quantization_config(directory, qconfig)
    return tensors


def write_dequantized_checkpoint(directory: str | Path, cfg: ModelConfig, fmt: str, quantized: dict[str, torch.Tensor],
                                 ignore: tuple[str, ...] = reference.EXPERTS_ONLY) -> None:
    """The full-precision checkpoint of compressed-tensors' own dequantization of ``quantized``."""
    qconfig = reference.quantization_config(fmt, ignore)
    save_checkpoint(directory, cfg, reference.dequantize(quantized, qconfig, expected_shapes(cfg)))
