"""Validation of a GenerateRequest: every bad field gets a ValueError naming it and its limit."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from proto import inference_pb2 as pb
from proto.convert import sampling_from_proto

if TYPE_CHECKING:  # the model's config imports torch; the Conductor's config (Limits) must not
    from engine.config import ModelConfig
    from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int
    max_new_tokens: int = 4096
    max_deadline_s: float = 3600.0
    default_deadline_s: float = 300.0
    # UTF-8 bytes: the transfer engine's ids are at most 64 bytes, and a retry or migration
    # ("/N", conductor.dispatch.placement_id) and a pull ("/pull") lengthen the id on the workers.
    max_request_id_len: int = 48
    max_tenant_len: int = 128
    max_slo_s: float = 3600.0
    max_prompt_bytes: int = 1 << 20


@dataclass(frozen=True)
class ValidRequest:
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    deadline_s: float
    tenant: str
    ttft_slo_s: float = 0.0  # 0: the tenant's or the cluster's
    tbt_slo_s: float = 0.0
    resumed: tuple[int, ...] = ()  # tokens sent before a failover (GenerateRequest.resume)


def validate(req: pb.GenerateRequest, cfg: ModelConfig, tokenizer: Tokenizer, limits: Limits) -> ValidRequest:
    if len(req.request_id.encode()) > limits.max_request_id_len or "/" in req.request_id:
        raise ValueError(f"request_id must be at most {limits.max_request_id_len} UTF-8 bytes without '/'")
    if len(req.tenant) > limits.max_tenant_len:
        raise ValueError(f"tenant must be at most {limits.max_tenant_len} characters, got {len(req.tenant)}")
    ids = _prompt_ids(req, cfg, tokenizer, limits)
    bad = next((t for t in ids if t >= cfg.vocab_size), None)
    if bad is not None:
        raise ValueError(f"token_ids: id {bad} outside the vocabulary [0, {cfg.vocab_size})")
    s = req.sampling
    max_new = min(limits.max_new_tokens, cfg.max_seq_len - len(ids))
    if not 1 <= s.max_tokens <= max_new:
        why = ("max_new_tokens" if max_new == limits.max_new_tokens else
               f"the prompt's {len(ids)} tokens leave {max_new} of the model's context of {cfg.max_seq_len}")
        raise ValueError(f"sampling.max_tokens must be in [1, {max_new}] ({why}), got {s.max_tokens}")
    for name in ("temperature", "top_p"):
        if not math.isfinite(getattr(s, name)):
            raise ValueError(f"sampling.{name} must be finite, got {getattr(s, name)}")
    params = sampling_from_proto(s)
    try:
        params.validate(cfg.vocab_size, max_new)
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from e
    if not 0 <= req.deadline_s <= limits.max_deadline_s or not math.isfinite(req.deadline_s):
        raise ValueError(f"deadline_s must be in [0, {limits.max_deadline_s}], got {req.deadline_s}")
    _check_slos(req, limits)
    resumed = tuple(req.resume.ids)
    if len(resumed) > s.max_tokens:  # all of them: the failed Conductor sent every token but not the finish
        raise ValueError(f"resume: {len(resumed)} tokens were sent already, more than "
                         f"sampling.max_tokens {s.max_tokens}")
    bad = next((t for t in resumed if t >= cfg.vocab_size), None)
    if bad is not None:
        raise ValueError(f"resume: id {bad} outside the vocabulary [0, {cfg.vocab_size})")
    return ValidRequest(tuple(ids), params, req.deadline_s or limits.default_deadline_s, req.tenant,
                        req.ttft_slo_s, req.tbt_slo_s, resumed)


def _prompt_ids(req: pb.GenerateRequest, cfg: ModelConfig, tokenizer: Tokenizer,
                limits: Limits) -> list[int]:
    """The prompt's token ids; sizes are checked before the
    tokenizer runs, so an oversized text costs no tokenization."""
    which = req.WhichOneof("prompt")
    if which is None:
        raise ValueError("prompt: give text or token_ids")
    # The field's name leads each message (a client's front may rename it: "prompt", "messages").
    limit = min(limits.max_prompt_tokens, cfg.max_seq_len - 1)
    why = (f"max_prompt_tokens; the model's context is {cfg.max_seq_len} tokens" if limit == limits.max_prompt_tokens
           else f"the model's context of {cfg.max_seq_len} tokens, less one to generate")
    if which == "text":
        if len(req.text) * 4 > limits.max_prompt_bytes:  # UTF-8 takes at most 4 bytes a character
            size = len(req.text.encode())
            if size > limits.max_prompt_bytes:
                raise ValueError(f"text: {size} bytes of UTF-8, the limit is {limits.max_prompt_bytes} "
                                 f"(max_prompt_bytes)")
        ids = tokenizer.encode(req.text)
    else:
        ids = list(req.token_ids.ids) if len(req.token_ids.ids) <= limit else []
        if not ids and req.token_ids.ids:
            raise ValueError(f"token_ids: {len(req.token_ids.ids)} tokens, the limit is {limit} ({why})")
    if not ids:
        raise ValueError(f"{which}: empty, give at least one token")
    if len(ids) > limit:
        raise ValueError(f"{which}: {len(ids)} tokens, the limit is {limit} ({why})")
    return ids


def _check_slos(req: pb.GenerateRequest, limits: Limits) -> None:
    for name in ("ttft_slo_s", "tbt_slo_s"):
        value = getattr(req, name)
        if not math.isfinite(value) or not 0 <= value <= limits.max_slo_s:
            raise ValueError(f"{name} must be in [0, {limits.max_slo_s}] seconds (0: the default), got {value}")
