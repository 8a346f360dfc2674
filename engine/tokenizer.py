"""Tokenizers: a byte-level one for the built-in model, ``tokenizer.json`` for checkpoints (Kimi's
``tiktoken.model`` is ``engine.tiktoken_tokenizer``).

The byte tokenizer maps UTF-8 bytes to ids 0-255, with BOS=256 and EOS=257. The tiny model's
vocabulary is larger than that; on decode, ids above 257 fold onto printable ASCII
(32 + id % 95) so that every sampled id shows as readable text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    BOS, EOS = 256, 257

    def __init__(self, vocab_size: int):
        if vocab_size < 258:
            raise ValueError(f"byte tokenizer needs vocab_size >= 258, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_id: int | None = self.EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        data = bytes(i if i < 256 else 32 + i % 95 for i in ids if i not in (self.BOS, self.EOS))
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` read through the ``tokenizers`` package."""

    def __init__(self, path: str | Path, eos_token_id: int | None):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
