"""From a trace to the requests a replay sends: selection, scaling, materialisation.

``TraceTransform`` is the frozen record of every choice (it goes into each report);
``apply_transform(trace, transform)`` is a pure function returning a ``ScaledTrace`` of
``ReplayRequest`` values that both the live replay and the simulator consume.

Order of operations (each recorded in the transform):

1. select: the arrival window ``[window_start_s, window_end_s)`` in trace seconds, then the
   index range ``[index_start, index_end)`` over what is left (``index_end=N`` = first N),
   then a seeded sample of ``sample_n`` requests (kept in arrival order);
2. time: ``arrival_s = (trace arrival - first selected arrival) / rate_scale``
   (``rate_scale=2`` replays twice as fast);
3. lengths: one trace block (``trace_block_tokens``, 512 for Mooncake) becomes
   ``tokens_per_trace_block = blocks_per_trace_block * block_size`` tokens: whole cluster
   blocks, so trace block boundaries are cache block boundaries. A prompt has
   ``ceil(input_len * length_scale)`` tokens, where ``length_scale`` defaults to
   ``tokens_per_trace_block / trace_block_tokens`` (every hash id used, the last one cut in
   proportion); a smaller scale keeps a prefix of the chain. Prompts are then cut to
   ``max_prompt_tokens``. Exact prompts (generic ``prompt_token_ids``) are only cut.
4. outputs: ``max_tokens = clamp(ceil(output_len * output_scale), 1, max_output_tokens)``;
5. SLOs: a request without its own ``ttft_slo_s``/``tbt_slo_s`` gets the transform's.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

from replay.tokens import DEFAULT_RESERVED_IDS, DEFAULT_VOCAB_SIZE, prompt_tokens
from replay.traces import MOONCAKE_BLOCK_TOKENS, Trace, TraceRequest


def _ceil(x: float) -> int:
    # Rounded first so that float noise (0.1 * 30 = 3.0000000000000004) does not add a token.
    return math.ceil(round(x, 6))


@dataclass(frozen=True)
class TraceTransform:
    """Every transformation from trace to replayed requests; units in the names."""

    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    block_size: int = 16
    blocks_per_trace_block: int = 1
    length_scale: float | None = None  # None: tokens_per_trace_block / trace_block_tokens
    output_scale: float = 1.0
    max_prompt_tokens: int = 8000
    max_output_tokens: int = 1024
    rate_scale: float = 1.0
    window_start_s: float | None = None
    window_end_s: float | None = None
    index_start: int | None = None
    index_end: int | None = None
    sample_n: int | None = None
    sample_seed: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    reserved_ids: tuple[int, ...] = DEFAULT_RESERVED_IDS
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("trace_block_tokens", "block_size", "blocks_per_trace_block", "max_prompt_tokens",
                     "max_output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("output_scale", "rate_scale", "length_scale", "ttft_slo_s", "tbt_slo_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v}")
        if self.length_scale is not None and self.length_scale > self.natural_length_scale + 1e-12:
            raise ValueError(f"length_scale {self.length_scale} exceeds {self.natural_length_scale} "
                             f"(= {self.tokens_per_trace_block}/{self.trace_block_tokens}): prompts would outrun "
                             "their hash ids; raise blocks_per_trace_block instead")
        if self.sample_n is not None and self.sample_n < 1:
            raise ValueError(f"sample_n must be >= 1, got {self.sample_n}")
        if None not in (self.window_start_s, self.window_end_s) and self.window_end_s <= self.window_start_s:
            raise ValueError(f"window end {self.window_end_s}s must be after its start {self.window_start_s}s")

    @property
    def tokens_per_trace_block(self) -> int:
        return self.blocks_per_trace_block * self.block_size

    @property
    def natural_length_scale(self) -> float:
        return self.tokens_per_trace_block / self.trace_block_tokens

    @property
    def effective_length_scale(self) -> float:
        return self.natural_length_scale if self.length_scale is None else self.length_scale

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["reserved_ids"] = list(self.reserved_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TraceTransform:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["reserved_ids"] = tuple(kw.get("reserved_ids", DEFAULT_RESERVED_IDS))
        return cls(**kw)


@dataclass(frozen=True)
class ReplayRequest:
    """One request as replayed: scaled arrival (s from replay start) and its prompt.

    ``hash_ids`` is the prefix of the trace chain that covers the prompt (empty for exact
    prompts); each id spans ``tokens_per_block`` tokens, i.e. cluster block ``j`` of the prompt
    is sub-block ``j % k`` of ``hash_ids[j // k]`` with ``k = blocks_per_trace_block``, so a
    consumer that works on blocks (the simulator) needs no tokens. ``prompt_ids`` holds the
    tokens, or is empty when ``apply_transform(..., materialise=False)``."""

    request_id: str  # stable per trace position: "t<index>" unless the trace names it
    index: int  # the TraceRequest's position in its file
    arrival_s: float
    prompt_len: int
    max_tokens: int
    prompt_ids: tuple[int, ...] = ()
    hash_ids: tuple[int, ...] = ()
    tokens_per_block: int = 0
    tenant: str = ""
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    trace_input_len: int = 0
    trace_output_len: int = 0

    def __post_init__(self) -> None:
        if self.prompt_ids and len(self.prompt_ids) != self.prompt_len:
            raise ValueError(f"request {self.request_id}: {len(self.prompt_ids)} prompt ids, prompt_len "
                             f"{self.prompt_len}")


@dataclass(frozen=True)
class ScaledTrace:
    """The result of ``apply_transform``: requests in arrival order plus what was done."""

    transform: TraceTransform
    requests: tuple[ReplayRequest, ...]
    source: str
    format: str
    num_in_trace: int
    trace_offset_s: float  # trace time of the first selected arrival (replay time 0)
    num_prompts_cut: int  # prompts shortened by max_prompt_tokens
    num_outputs_clamped: int  # outputs moved into [1, max_output_tokens]

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def describe(self) -> dict[str, Any]:
        """The report's ``trace`` section: everything except the requests."""
        return {"source": self.source, "format": self.format, "num_in_trace": self.num_in_trace,
                "num_selected": len(self.requests), "trace_offset_s": self.trace_offset_s,
                "num_prompts_cut": self.num_prompts_cut, "num_outputs_clamped": self.num_outputs_clamped,
                "transform": self.transform.to_dict()}


@dataclass(frozen=True)
class TiledTrace:
    """``copies`` back-to-back copies of a scaled trace, made one request at a time as
    ``requests`` is read (a run longer than any trace file, in the memory of one copy).

    Copy ``i`` arrives ``i * period_s`` later (more than the base's span of arrivals; by
    default its last arrival + 1 s), so copies follow one another; it has indexes
    ``i * num_in_trace + index``, request ids named after them, and hash ids shifted past every
    id of the base: copies share no prefix. Only block-level requests (hash ids, no prompt
    tokens) can be tiled."""

    base: ScaledTrace
    copies: int
    period_s: float | None = None

    def __post_init__(self) -> None:
        if self.copies < 1:
            raise ValueError(f"copies must be >= 1, got {self.copies}")
        if any(r.prompt_ids or not r.hash_ids for r in self.base.requests):
            raise ValueError("only requests made of hash ids (materialise=False) can be tiled")
        span_s = max(r.arrival_s for r in self.base.requests) - min(r.arrival_s for r in self.base.requests)
        if self.period_s is not None and not self.period_s > span_s:
            raise ValueError(f"period_s {self.period_s} must exceed the copy's span of arrivals, {span_s} s "
                             "(copies arrive one after another)")

    @property
    def transform(self) -> TraceTransform:
        return self.base.transform

    @property
    def num_requests(self) -> int:
        return self.base.num_requests * self.copies

    @property
    def effective_period_s(self) -> float:
        if self.period_s is not None:
            return self.period_s
        return max(r.arrival_s for r in self.base.requests) + 1.0

    @property
    def requests(self) -> Iterator[ReplayRequest]:
        """A fresh iterator over every copy's requests, in arrival order."""
        base, period = self.base, self.effective_period_s
        hash_stride = max(h for r in base.requests for h in r.hash_ids) + 1
        ordered = sorted(base.requests, key=lambda r: r.arrival_s)
        for i in range(self.copies):
            for r in ordered:
                index = i * base.num_in_trace + r.index
                yield dataclasses.replace(r, request_id=f"t{index}" if i else r.request_id, index=index,
                                          arrival_s=r.arrival_s + i * period,
                                          hash_ids=tuple(h + i * hash_stride for h in r.hash_ids) if i else r.hash_ids)

    def describe(self) -> dict[str, Any]:
        return {**self.base.describe(), "num_selected": self.num_requests,
                "tiled": {"copies": self.copies, "period_s": self.effective_period_s,
                          "num_per_copy": self.base.num_requests}}


def select(requests: tuple[TraceRequest, ...], t: TraceTransform) -> list[TraceRequest]:
    """Step 1: window, then index range, then a seeded sample; arrival order (stable)."""
    chosen = sorted(requests, key=lambda r: r.arrival_s)
    if t.window_start_s is not None:
        chosen = [r for r in chosen if r.arrival_s >= t.window_start_s]
    if t.window_end_s is not None:
        chosen = [r for r in chosen if r.arrival_s < t.window_end_s]
    chosen = chosen[t.index_start:t.index_end]
    if t.sample_n is not None and t.sample_n < len(chosen):
        keep = sorted(random.Random(t.sample_seed).sample(range(len(chosen)), t.sample_n))
        chosen = [chosen[i] for i in keep]
    return chosen


def scaled_prompt_len(r: TraceRequest, t: TraceTransform) -> int:
    """Step 3 before the ``max_prompt_tokens`` cut."""
    if r.prompt_ids is not None:
        return len(r.prompt_ids)
    return max(1, _ceil(r.input_len * t.effective_length_scale))


def scaled_output_len(output_len: int, t: TraceTransform) -> int:
    """Step 4: ``clamp(ceil(output_len * output_scale), 1, max_output_tokens)``."""
    return min(max(1, _ceil(output_len * t.output_scale)), t.max_output_tokens)


def _materialise(r: TraceRequest, t: TraceTransform, offset_s: float, materialise: bool) -> ReplayRequest:
    n = min(scaled_prompt_len(r, t), t.max_prompt_tokens)
    chain, ids = (), ()
    if r.prompt_ids is not None:
        bad = next((i for i in r.prompt_ids if i >= t.vocab_size), None)
        if bad is not None:
            raise ValueError(f"request {r.index}: prompt token id {bad} outside the vocabulary [0, {t.vocab_size})")
        ids = r.prompt_ids[:n]
    else:
        chain = r.hash_ids[:-(-n // t.tokens_per_trace_block)]
        if materialise:
            ids = prompt_tokens(chain, n, t.tokens_per_trace_block, t.vocab_size, t.reserved_ids)
    return ReplayRequest(
        request_id=r.request_id or f"t{r.index}", index=r.index, arrival_s=(r.arrival_s - offset_s) / t.rate_scale,
        prompt_len=n, max_tokens=scaled_output_len(r.output_len, t), prompt_ids=ids, hash_ids=chain,
        tokens_per_block=t.tokens_per_trace_block if chain else 0, tenant=r.tenant,
        ttft_slo_s=r.ttft_slo_s if r.ttft_slo_s is not None else t.ttft_slo_s,
        tbt_slo_s=r.tbt_slo_s if r.tbt_slo_s is not None else t.tbt_slo_s,
        trace_input_len=r.input_len, trace_output_len=r.output_len)


def apply_transform(trace: Trace, t: TraceTransform, *, materialise: bool = True) -> ScaledTrace:
    """Selects, scales and (unless ``materialise=False``: hash ids and lengths only, for block-level
    consumers at full trace scale) materialises the tokens; ValueError when nothing is selected
    or the trace's block length disagrees with the transform's."""
    if trace.block_tokens != t.trace_block_tokens:
        raise ValueError(f"the trace has {trace.block_tokens}-token blocks, the transform says "
                         f"{t.trace_block_tokens}")
    chosen = select(trace.requests, t)
    if not chosen:
        raise ValueError(f"the selection keeps no request of the {len(trace.requests)} in {trace.source or 'trace'}")
    offset_s = chosen[0].arrival_s
    out = tuple(_materialise(r, t, offset_s, materialise) for r in chosen)
    num_cut = sum(scaled_prompt_len(r, t) > t.max_prompt_tokens for r in chosen)
    num_clamped = sum(scaled_output_len(r.output_len, t) != _ceil(r.output_len * t.output_scale) for r in chosen)
    return ScaledTrace(transform=t, requests=out, source=trace.source, format=trace.format,
                       num_in_trace=len(trace.requests), trace_offset_s=offset_s, num_prompts_cut=num_cut,
                       num_outputs_clamped=num_clamped)
