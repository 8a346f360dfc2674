"""Live replay through the OpenAI-compatible HTTP front (``openai_api``) instead of gRPC.

``HttpSender`` has the gRPC sender's shape (``send``, ``stop``, ``now_s``, ``stopping``,
``cancelled_record``), so ``replay.live.run_live_replay`` drives either: an endpoint that
starts with ``http://`` or ``https://`` is the front's base URL (``.../v1``). Each request is
one streamed ``POST /completions`` with the prompt's token ids, ``ignore_eos`` (the trace
fixes the output length, as the gRPC replay does) and ``stream_options.include_usage``; the
SSE chunks give the token times, the extension field ``token_ids`` the token count, and the
usage chunk the cached prompt tokens. HTTP 429 is a rejection (``Retry-After`` kept); any
other error status, or a stream without a finish reason, is a failure with the reason.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx

from replay.progress import ReplayProgress
from replay.records import CANCELLED, FAILED, FINISHED, REJECTED, RequestRecord
from replay.transform import ReplayRequest


def is_http(endpoint: str) -> bool:
    return endpoint.startswith(("http://", "https://"))


def _body(r: ReplayRequest, request_id: str, model: str) -> dict[str, Any]:
    return {"model": model, "prompt": list(r.prompt_ids), "max_tokens": r.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "user": request_id}


class HttpSender:
    def __init__(self, base_url: str, t0: float, timeout_s: float, run_tag: str, progress: ReplayProgress,
                 model: str = "", api_key: str = ""):
        self.base_url, self.t0, self.timeout_s, self.run_tag, self.progress = (
            base_url.rstrip("/"), t0, timeout_s, run_tag, progress)
        self.model = model
        self.stopping = threading.Event()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers)

    def now_s(self) -> float:
        return time.perf_counter() - self.t0

    def stop(self) -> None:
        self.stopping.set()  # in-flight streams see it at their next chunk and close

    def close(self) -> None:
        self._client.close()

    def cancelled_record(self, r: ReplayRequest, why: str) -> RequestRecord:
        return _record(r, CANCELLED, arrival_s=r.arrival_s, status="CANCELLED", error=why)

    def _model(self) -> str:
        if not self.model:
            self.model = self._client.get(f"{self.base_url}/models").json()["data"][0]["id"]
        return self.model

    def send(self, r: ReplayRequest) -> RequestRecord:
        """One request, start to end; never raises (its outermost boundary)."""
        self.progress.started()
        if self.stopping.is_set():
            return self.cancelled_record(r, "replay stopped before the request was sent")
        arrival = self.now_s()
        try:
            return self._stream(r, arrival)
        except Exception as e:  # a sender thread's boundary: the request must still end
            return _record(r, FAILED, arrival_s=arrival, status="CLIENT_ERROR", error=f"client: {e!r}",
                           latency_s=self.now_s() - arrival)

    def _stream(self, r: ReplayRequest, arrival: float) -> RequestRecord:
        body = _body(r, f"{self.run_tag}-{r.index}", self._model())
        times: list[float] = []
        finish, cached, prompt_tokens = "", 0, 0
        with self._client.stream("POST", f"{self.base_url}/completions", json=body) as resp:
            if resp.status_code != 200:
                text = resp.read().decode(errors="replace")
                outcome = REJECTED if resp.status_code == 429 else FAILED
                retry = float(resp.headers["retry-after"]) if "retry-after" in resp.headers else None
                return _record(r, outcome, arrival_s=arrival, status=f"HTTP_{resp.status_code}", error=text[:500],
                               retry_after_s=retry, latency_s=self.now_s() - arrival)
            for line in resp.iter_lines():
                if self.stopping.is_set():
                    return _record(r, CANCELLED, arrival_s=arrival, status="CANCELLED", error="replay stopped",
                                   latency_s=self.now_s() - arrival, token_times_s=tuple(times))
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                now = self.now_s() - arrival
                for choice in chunk.get("choices", []):
                    times.extend([now] * len(choice.get("token_ids") or ()))
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage")
                if usage:
                    prompt_tokens = usage.get("prompt_tokens", 0)
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        outcome = FINISHED if finish in ("stop", "length") and times else FAILED
        return _record(r, outcome, arrival_s=arrival, finish_reason=finish, ttft_s=times[0] if times else None,
                       latency_s=self.now_s() - arrival, token_times_s=tuple(times), prompt_tokens=prompt_tokens,
                       cached_tokens=cached, error="" if outcome == FINISHED else "stream ended without a finish")


def _record(r: ReplayRequest, outcome: str, **kw: Any) -> RequestRecord:
    return RequestRecord(request_id=r.request_id, index=r.index, source="live", outcome=outcome,
                         scheduled_s=r.arrival_s, prompt_len=r.prompt_len, max_tokens=r.max_tokens, tenant=r.tenant,
                         ttft_slo_s=r.ttft_slo_s, tbt_slo_s=r.tbt_slo_s, **kw)
