"""Incremental detokenization: token ids arriving in deltas -> text deltas whose
concatenation is the decoded text, in O(delta) per step rather than O(all tokens).

It decodes a short window (the text since the last emission plus the new tokens) and holds
back a tail that ends in U+FFFD, the mark of a character whose bytes have not all arrived
(the byte tokenizer splits multi-byte UTF-8 characters across tokens)::

    ids     [ ... emitted ... | prefix_offset ... read_offset | new ids ]
    delta = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

Used by the Conductor's stream and the HTTP front.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer

INCOMPLETE = "\ufffd"


class Detokenizer:
    """Not thread-safe: one per request."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, new_ids: Sequence[int]) -> str:
        """Appends token ids; returns the newly complete text (maybe "")."""
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset:self._read_offset])
        text = self.tokenizer.decode(self.ids[self._prefix_offset:])
        if len(text) > len(prefix) and not text.endswith(INCOMPLETE):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        """The held-back tail (incomplete characters included, as U+FFFD) at the end of the stream."""
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset:self._read_offset])
        text = self.tokenizer.decode(self.ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self.ids)
        return text[len(prefix):]
