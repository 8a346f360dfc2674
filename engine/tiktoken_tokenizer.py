"""Kimi's tokenizer: ``tiktoken.model`` (a BPE rank file) and ``tokenizer_config.json``, on tiktoken.

Owns reading the two files as K2, K2-Thinking, K2.5 and K3 ship them and the encode/decode the
Conductor and the HTTP front run:

- ``tiktoken.model``: one ``base64(token bytes) rank`` per line, loaded by
  ``tiktoken.load.load_tiktoken_bpe`` (with the file's own hash, so tiktoken's on-disk cache
  can never hand back an older file of the same path).
- Special tokens: ``tokenizer_config.json``'s ``added_tokens_decoder`` by id; as Kimi's own
  tokenizer does, the 256 ids after the ranks are all special, the unnamed ones
  ``<|reserved_token_{id}|>``. EOS is ``eos_token`` there (``<|im_end|>`` ends a chat turn in
  Kimi's templates), else config.json's ``eos_token_id``.
- The split pattern is Kimi's (``KIMI_PATTERN``: Han runs apart, case-aware words, digits in
  threes). Text is encoded with every special token recognised (a chat template writes them as
  text), in windows of 400,000 characters with runs of one kind (whitespace or not) cut at
  25,000, as Kimi's tokenizer does to keep tiktoken's BPE from going quadratic.
- Decode drops special tokens and ids outside the tokenizer, and marks incomplete UTF-8 as
  U+FFFD (what ``engine.detokenizer`` holds back on).

Immutable after construction; thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from engine.checkpoint import CheckpointError

RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
NUM_RESERVED_SPECIAL = 256
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
_LONG_RUN = re.compile(rf"\s{{{MAX_RUN_CHARS + 1},}}|\S{{{MAX_RUN_CHARS + 1},}}")


class TiktokenTokenizer:
    def __init__(self, directory: str | Path, default_eos_token_id: int | None):
        import tiktoken
        import tiktoken.load

        directory = Path(directory)
        ranks_path, config_path = directory / RANKS_FILE, directory / CONFIG_FILE
        digest = hashlib.sha256(ranks_path.read_bytes()).hexdigest()
        try:
            ranks = tiktoken.load.load_tiktoken_bpe(str(ranks_path), expected_hash=digest)
        except ValueError as e:
            raise CheckpointError(f"{ranks_path}: not a tiktoken BPE rank file ({e})") from e
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise CheckpointError(f"{ranks_path}: ranks must be 0..{len(ranks) - 1}, each once")
        config = _read_config(config_path)
        self.special = _special_tokens(config, len(ranks), config_path)
        self._special_ids = frozenset(self.special.values())
        self._encoding = tiktoken.Encoding(name=str(ranks_path), pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                           special_tokens=self.special)
        self.vocab_size = self._encoding.n_vocab
        eos = _token_text(config.get("eos_token"))
        if eos and eos not in self.special:
            raise CheckpointError(f"{config_path}: eos_token {eos!r} is not one of its special tokens")
        self.eos_token_id: int | None = self.special[eos] if eos else default_eos_token_id
        bos = _token_text(config.get("bos_token"))
        self.bos_token_id: int | None = self.special.get(bos) if bos else None

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in _pieces(text):
            out.extend(self._encoding.encode(piece, allowed_special="all", disallowed_special=()))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        kept = [i for i in ids if 0 <= i < self.vocab_size and i not in self._special_ids]
        return self._encoding.decode_bytes(kept).decode("utf-8", errors="replace")


def _pieces(text: str) -> Iterator[str]:
    """``text`` in windows of at most MAX_ENCODE_CHARS, each cut inside any run of more than
    MAX_RUN_CHARS whitespace (or non-whitespace) characters, every MAX_RUN_CHARS of the run."""
    for lo in range(0, max(len(text), 1), MAX_ENCODE_CHARS):
        window = text[lo : lo + MAX_ENCODE_CHARS]
        start = 0
        for run in _LONG_RUN.finditer(window):
            for cut in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield window[start:cut]
                start = cut
        yield window[start:]


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: must hold a JSON object")
    return config


def _special_tokens(config: dict[str, Any], num_ranks: int, path: Path) -> dict[str, int]:
    """text -> id of every special token: the named ones, and the reserved ids after the ranks."""
    named: dict[int, str] = {}
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise CheckpointError(f"{path}: added_tokens_decoder must map ids to tokens")
    for key, entry in decoder.items():
        text = _token_text(entry)
        if not str(key).isdigit() or not text:
            raise CheckpointError(f"{path}: added_tokens_decoder entry {key!r} needs an integer id and a content")
        if int(key) < num_ranks:
            raise CheckpointError(f"{path}: added token {text!r} has id {key}, which is a BPE rank "
                                  f"(special ids start at {num_ranks})")
        named[int(key)] = text
    top = max([num_ranks + NUM_RESERVED_SPECIAL - 1, *named])
    special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_ranks, top + 1)}
    if len(special) != top + 1 - num_ranks:
        raise CheckpointError(f"{path}: added_tokens_decoder names one token twice")
    return special


def _token_text(value: object) -> str:
    """tokenizer_config.json writes a token as a string or as ``{"content": ...}``."""
    if isinstance(value, dict):
        return str(value.get("content") or "")
    return value if isinstance(value, str) else ""
