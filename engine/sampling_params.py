"""``SamplingParams``: how a request samples, validated once with messages that name the field
and its limit. A frozen value of plain numbers: the Conductor, the wire conversion and the
simulator use it without importing torch (``engine.sampler`` samples with it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def validate(self, vocab_size: int, max_new_tokens_limit: int = 1 << 20) -> None:
        """Raises ValueError naming the first bad field and its limit."""
        if not 1 <= self.max_new_tokens <= max_new_tokens_limit:
            raise ValueError(f"max_new_tokens must be in [1, {max_new_tokens_limit}], got {self.max_new_tokens}")
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.top_k <= vocab_size):
            raise ValueError(f"top_k must be in [0, {vocab_size}], got {self.top_k}")
        if not (0 <= self.seed < 1 << 63):
            raise ValueError(f"seed must be in [0, 2^63), got {self.seed}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {bad[0]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
