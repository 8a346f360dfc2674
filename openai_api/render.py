"""OpenAI response shapes: whole responses, SSE chunks and the ``data: [DONE]`` end.

``Shape`` knows one endpoint's objects (``text_completion`` or ``chat.completion``); the
extension field ``token_ids`` (as vLLM's ``return_token_ids``) sits in each choice: in a
whole response every generated id, in a chunk the ids received since the previous chunk.
A stream is: [chat only: a role chunk] text chunks, a finish chunk, [a usage chunk with
``choices: []`` when ``stream_options.include_usage``], ``data: [DONE]``. With
``include_usage`` every other chunk carries ``"usage": null``, as OpenAI's do.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True)
class Shape:
    chat: bool
    response_id: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def response(self, text: str, token_ids: list[int], finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason, "token_ids": token_ids}
            out = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "token_ids": token_ids}
            out = self._envelope("text_completion", [choice])
        out["usage"] = usage
        return out

    def chunk(self, text: str | None, token_ids: tuple[int, ...] | list[int], finish_reason: str | None = None,
              role: bool = False) -> bytes:
        """One SSE event; ``role`` makes the chat stream's opening chunk."""
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                      "token_ids": list(token_ids)}
            out = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason,
                      "token_ids": list(token_ids)}
            out = self._envelope("text_completion", [choice])
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def usage_chunk(self, usage: dict) -> bytes:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = usage
        return sse(out)


def error_event(body: dict) -> bytes:
    """A failure after the stream began: the HTTP status is already sent, so it is an event."""
    return sse(body)
