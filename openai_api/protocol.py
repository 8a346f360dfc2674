"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions`` -> ``GenerationParams``.

The front checks what is HTTP-specific: JSON types, fields the Conductor cannot express
(``n``, ``best_of``, ``logprobs``, ``echo``, ``suffix``, penalties, ``logit_bias``, several
prompts, ``top_p`` 0, which the wire reads as "unset"), ``stream_options``, ``stop`` and the
chat ``messages``. Ranges that depend on the model or the cluster (``max_tokens`` against the
context, ``temperature``, ``top_k`` against the vocabulary, prompt length, token ids) are the
Conductor's: its INVALID_ARGUMENT names its field, which ``field_names`` renames to the
OpenAI one. Every refusal is ``ApiError`` 400 (404 for an unknown ``model``) naming the field.

Extensions beyond OpenAI's fields, as vLLM spells them: ``top_k`` (-1 or 0 = off),
``stop_token_ids``, ``ignore_eos`` (by default the tokenizer's EOS id stops generation).
Without ``seed`` a random one is drawn, so sampling is not repeatable unless asked to be.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from openai_api.chat_template import ChatTemplate
from openai_api.errors import ApiError, invalid
from proto import inference_pb2 as pb

UINT32_MAX = (1 << 32) - 1
MAX_STOP_STRINGS = 16
ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields OpenAI defines that Tidekv cannot honour: refused unless given their neutral value.
NEUTRAL = {"best_of": (None, 1), "echo": (None, False), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
           "suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
           "logit_bias": (None, {}), "tools": (None, []), "response_format": (None, {"type": "text"})}


@dataclass(frozen=True)
class RequestContext:
    """What parsing needs from the front's config and model."""

    served_model_name: str
    eos_token_id: int | None
    max_model_len: int
    default_max_tokens: int       # completions (OpenAI's default is 16)
    default_chat_max_tokens: int  # chat, capped by what fits in the context


@dataclass(frozen=True)
class GenerationParams:
    prompt: str | tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    stream: bool
    include_usage: bool
    user: str
    field_names: tuple[tuple[str, str], ...]  # Conductor field -> OpenAI field, for its error messages

    def to_proto(self, request_id: str, tenant: str = "") -> pb.GenerateRequest:
        sampling = pb.SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                     top_k=self.top_k, seed=self.seed, stop_token_ids=list(self.stop_token_ids))
        if isinstance(self.prompt, str):
            return pb.GenerateRequest(request_id=request_id, text=self.prompt, sampling=sampling, tenant=tenant)
        return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=list(self.prompt)),
                                  sampling=sampling, tenant=tenant)


# ---- typed field readers: each raises a 400 naming the field ----------------------------------
def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise invalid(name, f"{name} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise invalid(name, f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _number(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not (isinstance(v, int | float) and not isinstance(v, bool)) or not math.isfinite(v):
        raise invalid(name, f"{name} must be a finite number, got {v!r}")
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"{name} must be a boolean, got {type(v).__name__}")
    return v


def _str(body: dict, name: str) -> str:
    v = body.get(name)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise invalid(name, f"{name} must be a string, got {type(v).__name__}")
    return v


# ---- shared fields --------------------------------------------------------------------------
def check_model(body: object, ctx: RequestContext) -> dict:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    model = body.get("model")
    if model is None or model == "":
        raise invalid("model", "model is required")
    if not isinstance(model, str):
        raise invalid("model", f"model must be a string, got {type(model).__name__}")
    if model != ctx.served_model_name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{ctx.served_model_name}`",
                       param="model", code="model_not_found")
    return body


def _unsupported(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise invalid("n", f"n must be 1 (one choice per request), got {n!r}")
    for name, neutral in NEUTRAL.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in neutral):
            raise invalid(name, f"{name} is not supported by this server")


def _stops(body: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
    stop = body.get("stop")
    strings = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise invalid("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(strings) > MAX_STOP_STRINGS:
        raise invalid("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(strings)}")
    ids = body.get("stop_token_ids")
    ids = [] if ids is None else ids
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t <= UINT32_MAX for t in ids):
        raise invalid("stop_token_ids", "stop_token_ids must be a list of non-negative integers")
    return tuple(strings), tuple(ids)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(opts, dict):
        raise invalid("stream_options", "stream_options must be an object")
    return stream, _bool(opts, "include_usage")


def _params(body: dict, ctx: RequestContext, prompt: str | tuple[int, ...], max_tokens_field: str,
            default_max_tokens: int, prompt_field: str) -> GenerationParams:
    _unsupported(body)
    # The context bounds max_tokens here; the Conductor's limit (prompt length, its own cap) is tighter.
    max_tokens = _int(body, max_tokens_field, default_max_tokens, 1, ctx.max_model_len)
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise invalid("top_p", f"top_p must be in (0, 1], got {top_p:g}")
    top_k = _int(body, "top_k", 0, -1, UINT32_MAX)
    seed = _int(body, "seed", None, 0, (1 << 63) - 1)
    stop, stop_ids = _stops(body)
    if not _bool(body, "ignore_eos") and ctx.eos_token_id is not None and ctx.eos_token_id not in stop_ids:
        stop_ids = (*stop_ids, ctx.eos_token_id)
    stream, include_usage = _stream(body)
    names = (("max_tokens", max_tokens_field), ("max_new_tokens", max_tokens_field), ("text", prompt_field),
             ("token_ids", prompt_field), ("prompt", prompt_field), ("temperature", "temperature"),
             ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "seed"), ("stop_token_ids", "stop_token_ids"))
    return GenerationParams(
        prompt=prompt, max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0), top_p=top_p,
        top_k=max(top_k, 0), seed=secrets.randbits(63) if seed is None else seed, stop=stop,
        stop_token_ids=stop_ids, stream=stream, include_usage=include_usage, user=_str(body, "user"),
        field_names=names)


# ---- the two endpoints ------------------------------------------------------------------------
def _prompt(body: dict) -> str | tuple[int, ...]:
    p = body.get("prompt")
    if p is None:
        raise invalid("prompt", "prompt is required")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one prompt
    if isinstance(p, str):
        if not p:
            raise invalid("prompt", "prompt must not be empty")
        return p
    if isinstance(p, list) and p and all(_is_int(t) and 0 <= t <= UINT32_MAX for t in p):
        return tuple(p)
    if isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
        raise invalid("prompt", f"prompt holds {len(p)} prompts; this server takes one prompt per request")
    raise invalid("prompt", "prompt must be a non-empty string or a non-empty list of token ids")


def parse_completion(body: object, ctx: RequestContext) -> GenerationParams:
    body = check_model(body, ctx)
    return _params(body, ctx, _prompt(body), "max_tokens", ctx.default_max_tokens, "prompt")


def _content(i: int, content: object) -> str:
    """A message's content: a string, or a list of text parts (concatenated)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
        raise invalid(f"messages[{i}].content", f"messages[{i}].content: only text parts are supported")
    raise invalid(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")


def parse_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "messages is required")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", f"messages[{i}] must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        out.append({"role": role, "content": "" if content is None else _content(i, content)})
    return out


def parse_chat(body: object, ctx: RequestContext, template: ChatTemplate,
               encode: Callable[[str], Sequence[int]]) -> GenerationParams:
    """``encode`` turns the rendered prompt into token ids: the front tokenizes chat prompts
    itself, since the default ``max_completion_tokens`` is what fits after them."""
    body = check_model(body, ctx)
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    messages = parse_messages(body)
    try:
        text = template.render(messages, add_generation_prompt=True)
    except ValueError as e:
        raise invalid("messages", str(e)) from e
    ids = tuple(encode(text))
    default = max(1, min(ctx.default_chat_max_tokens, ctx.max_model_len - len(ids)))
    return _params(body, ctx, ids, field, default, "messages")
