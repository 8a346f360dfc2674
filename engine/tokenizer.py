"""Tokenizers: one token per character for the built-in model, ``tokenizer.json`` for checkpoints
(Kimi's ``tiktoken.model`` is ``engine.tiktoken_tokenizer``).

The built-in model's ``CharTokenizer`` gives every id exactly one character, so that any ids
the model samples decode to text that encodes back to the same ids, one token per character
(a peer tool that counts tokens by re-encoding the text, as aiperf does, counts what
``usage`` says). It replaced a byte tokenizer whose ids 128-255, sampled alone, decoded to
U+FFFD (three tokens on re-encoding). The vocabulary::

    ids 0-255      U+0000-U+00FF (Latin-1; ASCII text keeps its byte ids)
    id  256, 257   BOS and EOS: special, decode to nothing
    id  258        U+FFFD, also the id of any character outside the vocabulary
    ids 259-       CJK ideographs from U+4E00, one per id (printable, one code point each)

``engine.model_files`` writes the same vocabulary as a Hugging Face ``tokenizer.json`` (a
WordLevel model over single characters), so peers tokenize exactly as Tidekv does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

CJK_BASE, CJK_SIZE = 0x4E00, 0x9FFF - 0x4E00 + 1


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class CharTokenizer:
    """Immutable after construction; thread-safe."""

    BOS, EOS, UNK = 256, 257, 258
    BOS_TEXT, EOS_TEXT, UNK_TEXT = "<|tidekv:bos|>", "<|tidekv:eos|>", "\ufffd"
    _SPECIAL = re.compile(r"(<\|tidekv:(?:bos|eos)\|>)")

    def __init__(self, vocab_size: int):
        if not self.UNK < vocab_size <= self.UNK + 1 + CJK_SIZE:
            raise ValueError(f"the character tokenizer needs vocab_size in [{self.UNK + 1}, "
                             f"{self.UNK + 1 + CJK_SIZE}], got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_id: int | None = self.EOS
        self.chars = (*map(chr, range(256)), "", "", self.UNK_TEXT,
                      *(chr(CJK_BASE + i) for i in range(vocab_size - self.UNK - 1)))
        self._ids = {c: i for i, c in enumerate(self.chars) if c}
        self._specials = {self.BOS_TEXT: self.BOS, self.EOS_TEXT: self.EOS}

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` (the special tokens' names for BOS and EOS)."""
        return {self.BOS: self.BOS_TEXT, self.EOS: self.EOS_TEXT}.get(token_id) or self.chars[token_id]

    def encode(self, text: str) -> list[int]:
        if "<|tidekv:" in text:
            out: list[int] = []
            for part in self._SPECIAL.split(text):
                out += [self._specials[part]] if part in self._specials else self._encode_plain(part)
            return out
        return self._encode_plain(text)

    def _encode_plain(self, text: str) -> list[int]:
        try:
            return list(text.encode("latin-1"))  # the common case, at C speed
        except UnicodeEncodeError:
            get = self._ids.get
            return [get(c, self.UNK) for c in text]

    def decode(self, ids: list[int]) -> str:
        chars, n = self.chars, self.vocab_size
        return "".join(chars[i] if 0 <= i < n else self.UNK_TEXT for i in ids)


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
