"""A Hugging Face-style directory for every model Tidekv serves, so peer tools work offline.

Benchmark clients (aiperf, guidellm) and SDKs load a tokenizer and a config by directory
(``--tokenizer DIR``, ``AutoTokenizer.from_pretrained(DIR)``). A checkpoint directory is its
own. For the built-in ``tiny``, ``model_files_dir`` writes on first use, under
``<cache_dir>/models/tiny`` (the cache directory of the calibration, ``~/.cache/tidekv``,
or a data directory given instead):

    config.json             the model's config (``ModelConfig.to_dict`` plus ``architectures``
                            and ``max_position_embeddings``)
    tokenizer.json          ``engine.tokenizer.CharTokenizer`` as a WordLevel model over single
                            characters: the same ids for any text, the same text for any ids
    tokenizer_config.json   the special tokens, the context length and the chat template
    generation_config.json  BOS and EOS

Files are rewritten when their content differs (a newer Tidekv), so the directory always
matches the code that serves the model; no weights are written (peers need none).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from engine.config import ModelConfig, tiny_config
from engine.tokenizer import CharTokenizer

DEFAULT_CACHE_DIR = Path("~/.cache/tidekv")
# One line per message, then the assistant's turn: the built-in model's chat template (and the
# front's fallback for a checkpoint without one).
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _added(token_id: int, content: str) -> dict[str, Any]:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def tokenizer_json(tok: CharTokenizer) -> dict[str, Any]:
    """``tok`` in the ``tokenizers`` library's format: every character one token, the rest unknown."""
    vocab = {tok.token_text(i): i for i in range(tok.vocab_size)}
    assert len(vocab) == tok.vocab_size, "two ids share a character"
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added(tok.BOS, tok.BOS_TEXT), _added(tok.EOS, tok.EOS_TEXT)],
        "normalizer": None,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": r"[\s\S]"}, "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": tok.UNK_TEXT},
    }


def tiny_files(cfg: ModelConfig | None = None) -> dict[str, str]:
    """File name -> text of the built-in model's directory."""
    cfg = cfg or tiny_config()
    tok = CharTokenizer(cfg.vocab_size)
    config = {**cfg.to_dict(), "architectures": ["KimiLinearForCausalLM"],
              "max_position_embeddings": cfg.max_seq_len}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.BOS_TEXT, "eos_token": tok.EOS_TEXT,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": cfg.max_seq_len,
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    docs = {"config.json": config, "tokenizer.json": tokenizer_json(tok), "tokenizer_config.json": tokenizer_config,
            "generation_config.json": generation}
    return {name: json.dumps(doc, indent=1, ensure_ascii=False) + "\n" for name, doc in docs.items()}


def model_files_dir(model: str, cache_dir: str | Path | None = None) -> Path:
    """The Hugging Face-style directory of ``model`` ("tiny" or a checkpoint directory), written
    for "tiny" when missing or stale. OSError when the cache directory cannot be written."""
    if model != "tiny":
        return Path(model).resolve()
    directory = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "models" / "tiny"
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in tiny_files().items():
        path = directory / name
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # public data: a peer tool run by anyone may read it
        os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
    return directory
