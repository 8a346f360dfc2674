"""Live replay: send ``ReplayRequest``s to a Conductor at their arrival times and record each one.

``run_live_replay`` owns one gRPC channel (``conductor.client.Client``; or, for an ``http://``
endpoint, an HTTP client of the OpenAI front: ``replay.live_http``) and a pool of
``max_concurrency`` sender threads. The calling thread waits for each scheduled arrival (an
``Event`` wait, so Ctrl-C stops it at once) and hands the request to the pool; a request that
finds every sender busy starts late, and its record shows both ``scheduled_s`` and the actual
``arrival_s``. Each sender streams one ``Generate`` call to its end and turns it into exactly
one ``RequestRecord``:

- terminal message STOP/LENGTH -> finished; FAILED -> failed (its error); REJECTED -> rejected;
- gRPC RESOURCE_EXHAUSTED -> rejected, with the ``retry-after-s`` trailer as ``retry_after_s``;
- any other gRPC status, a stream without exactly one terminal message, or a client-side
  error -> failed with the reason;
- Ctrl-C (or ``stop``) -> in-flight calls are cancelled and unsent requests recorded as
  cancelled, so no request is ever missing from the report.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc

from conductor.client import Client, ResumableCall
from proto import inference_pb2 as pb
from replay.live_http import HttpSender, is_http
from replay.progress import ReplayProgress
from replay.records import CANCELLED, FAILED, FINISHED, REJECTED, RequestRecord
from replay.report import write_report
from replay.summary import Summary, summarize
from replay.transform import ReplayRequest, ScaledTrace

log = logging.getLogger(__name__)

_TERMINAL = {pb.FINISH_REASON_STOP: (FINISHED, "stop"), pb.FINISH_REASON_LENGTH: (FINISHED, "length"),
             pb.FINISH_REASON_FAILED: (FAILED, ""), pb.FINISH_REASON_REJECTED: (REJECTED, ""),
             pb.FINISH_REASON_CANCELLED: (CANCELLED, "")}


@dataclass(frozen=True)
class LiveResult:
    records: tuple[RequestRecord, ...]  # in arrival order, one per request
    summary: Summary
    paths: tuple[Path, ...] = ()  # report files written (empty without out_dir)


def _has_field(name: str) -> bool:
    return name in pb.GenerateRequest.DESCRIPTOR.fields_by_name


def to_proto(r: ReplayRequest, server_request_id: str) -> pb.GenerateRequest:
    """The GenerateRequest of one replayed request (greedy; SLOs only where the proto has them)."""
    req = Client.request(list(r.prompt_ids), max_tokens=r.max_tokens, tenant=r.tenant, request_id=server_request_id)
    for name in ("ttft_slo_s", "tbt_slo_s"):
        value = getattr(r, name)
        if value is not None and _has_field(name):
            setattr(req, name, value)
    return req


@dataclass
class _Stream:
    """What one Generate stream has shown so far (owned by one sender thread)."""

    times: list[float] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)
    num_terminal: int = 0
    terminal: int = pb.FINISH_REASON_UNSPECIFIED
    error: str = ""

    def take(self, msg: pb.GenerateResponse, now_s: float) -> None:
        self.times.extend([now_s] * len(msg.token_ids))
        f = self.fields
        if msg.request_id:
            f["server_request_id"] = msg.request_id
        for name in ("prefill_worker", "decode_worker", "route_branch", "pulled_from"):
            if getattr(msg, name, ""):
                f[name] = getattr(msg, name)
        if msg.HasField("usage") and msg.usage.prompt_tokens:
            f["prompt_tokens"], f["cached_tokens"] = msg.usage.prompt_tokens, msg.usage.cached_tokens
            f["loaded_cached_tokens"] = msg.usage.loaded_cached_tokens
        if msg.finish_reason:
            self.num_terminal += 1
            self.terminal, self.error = msg.finish_reason, msg.error
            if msg.HasField("timing"):
                f["queue_s"] = msg.timing.queue_s
                if msg.timing.prefill_worker_s:
                    f["prefill_worker_s"] = msg.timing.prefill_worker_s
                for name in ("predicted_ttft_s", "predicted_tbt_s"):
                    if getattr(msg.timing, name, 0.0):
                        f[name] = getattr(msg.timing, name)

    def outcome(self) -> tuple[str, str, str]:
        """(outcome, finish_reason, error) of a stream that ended with status OK."""
        if self.num_terminal != 1:
            return FAILED, "", f"stream ended with {self.num_terminal} terminal messages (expected exactly 1)"
        outcome, reason = _TERMINAL.get(self.terminal, (FAILED, ""))
        return outcome, reason, self.error


def _retry_after_s(e: grpc.RpcError) -> float | None:
    """The Conductor's ``retry-after-s`` trailer of a refused call, when it sent one."""
    trailers = e.trailing_metadata() if isinstance(e, grpc.Call) else None
    value = dict(trailers or ()).get("retry-after-s")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


OnMessage = Callable[[ReplayRequest, pb.GenerateResponse], None]


class _Sender:
    """Streams requests over one client; tracks live calls so that ``stop`` can cancel them."""

    def __init__(self, client: Client, t0: float, timeout_s: float, run_tag: str, progress: ReplayProgress,
                 on_message: OnMessage | None = None):
        self.client, self.t0, self.timeout_s, self.run_tag, self.progress = client, t0, timeout_s, run_tag, progress
        self.on_message = on_message
        self.stopping = threading.Event()
        self._calls: dict[str, ResumableCall] = {}
        self._lock = threading.Lock()

    def now_s(self) -> float:
        return time.perf_counter() - self.t0

    def stop(self) -> None:
        with self._lock:  # with the registration in _stream: every call is either seen here or sees stopping
            self.stopping.set()
            calls = list(self._calls.values())
        for call in calls:
            call.cancel()

    def cancelled_record(self, r: ReplayRequest, why: str) -> RequestRecord:
        return _base_record(r, CANCELLED, arrival_s=r.arrival_s, status="CANCELLED", error=why)

    def send(self, r: ReplayRequest) -> RequestRecord:
        """One request, start to end; never raises (its outermost boundary)."""
        self.progress.started()  # taken by a sender (also when it only records a cancellation)
        if self.stopping.is_set():
            return self.cancelled_record(r, "replay stopped before the request was sent")
        arrival = self.now_s()
        try:
            return self._stream(r, arrival)
        except Exception as e:  # a sender thread's boundary: the request must still end
            log.exception("request %s: client-side error", r.request_id)
            return _base_record(r, FAILED, arrival_s=arrival, status="CLIENT_ERROR", error=f"client: {e!r}",
                                latency_s=self.now_s() - arrival)

    def _stream(self, r: ReplayRequest, arrival: float) -> RequestRecord:
        sid = f"{self.run_tag}-{r.index}"
        s = _Stream()
        call = self.client.stream(to_proto(r, sid), timeout_s=self.timeout_s)  # resumed on another replica
        with self._lock:
            self._calls[sid] = call
            if self.stopping.is_set():
                call.cancel()
        status, retry, outcome, reason = "OK", None, "", ""
        try:
            for msg in call:
                s.take(msg, self.now_s() - arrival)
                if self.on_message is not None:
                    self.on_message(r, msg)
            outcome, reason, error = s.outcome()
        except grpc.RpcError as e:
            code = e.code()
            status, error = code.name, f"{code.name}: {e.details()}"
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                outcome, retry = REJECTED, _retry_after_s(e)
            else:
                outcome = CANCELLED if code == grpc.StatusCode.CANCELLED and self.stopping.is_set() else FAILED
        finally:
            with self._lock:
                self._calls.pop(sid, None)
        f = s.fields
        return _base_record(r, outcome, arrival_s=arrival, status=status, finish_reason=reason, error=error,
                            retry_after_s=retry, ttft_s=s.times[0] if s.times else None,
                            latency_s=self.now_s() - arrival, token_times_s=tuple(s.times), **f)


def _base_record(r: ReplayRequest, outcome: str, **kw: Any) -> RequestRecord:
    return RequestRecord(request_id=r.request_id, index=r.index, source="live", outcome=outcome,
                         scheduled_s=r.arrival_s, prompt_len=r.prompt_len, max_tokens=r.max_tokens, tenant=r.tenant,
                         ttft_slo_s=r.ttft_slo_s, tbt_slo_s=r.tbt_slo_s, **kw)


def _dispatch(sender: _Sender, requests: Sequence[ReplayRequest], pool: ThreadPoolExecutor,
              progress: ReplayProgress, futures: list[Future | None]) -> None:
    """Submits each request at its arrival time into ``futures`` (in place, so that an interrupt
    keeps what was sent); stops early, leaving None for the rest, when stopping."""

    def finish(fut: Future) -> None:
        progress.done(fut.result())

    for i, r in enumerate(requests):
        delay = r.arrival_s - sender.now_s()
        if delay > 0 and sender.stopping.wait(delay):
            break
        if sender.stopping.is_set():
            break
        progress.submitted()  # before the submit: a sender may start it (``started``) at once
        futures[i] = pool.submit(sender.send, r)
        futures[i].add_done_callback(finish)


def run_live_replay(trace_requests: ScaledTrace | Sequence[ReplayRequest], endpoint: str, *,
                    max_concurrency: int = 16, out_dir: str | Path | None = None, timeout_s: float = 300.0,
                    plots: bool = True, progress: bool = True, progress_stream: TextIO | None = None,
                    api_key: str = "", tls_ca: str = "", on_message: OnMessage | None = None) -> LiveResult:
    """Replays the requests against the Conductor at ``endpoint`` and returns one record per
    request (arrival order) and the summary; with ``out_dir``, writes the report there.
    Blocks until every request has ended (each call is bounded by ``timeout_s``). Ctrl-C cancels
    what is in flight, records the rest as cancelled, and still returns (and writes) the report.
    The progress line goes to ``progress_stream`` (default: the current ``sys.stderr``).
    ``api_key`` authenticates every request (gRPC metadata or the HTTP header); ``tls_ca``
    verifies a Conductor serving TLS. ``on_message(request, response)`` (gRPC endpoints only)
    sees every streamed message on its sender thread, e.g. to keep token ids, which the
    records do not carry; it must be quick and must not raise."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if on_message is not None and is_http(endpoint):
        raise ValueError("on_message needs a gRPC endpoint: the HTTP front streams OpenAI chunks")
    scaled = trace_requests if isinstance(trace_requests, ScaledTrace) else None
    requests = sorted(scaled.requests if scaled else trace_requests, key=lambda r: r.arrival_s)
    unmaterialised = next((r.request_id for r in requests if not r.prompt_ids), None)
    if unmaterialised is not None:
        raise ValueError(f"request {unmaterialised} has no prompt tokens: apply_transform(..., materialise=True)")
    bar = ReplayProgress(len(requests), (progress_stream or sys.stderr) if progress else None)
    if is_http(endpoint):  # the OpenAI HTTP front's base URL
        sender = HttpSender(endpoint, time.perf_counter(), timeout_s, uuid.uuid4().hex[:8], bar, api_key=api_key)
        client = sender
    else:
        client = Client(endpoint, api_key=api_key, tls_ca=tls_ca)
        sender = _Sender(client, time.perf_counter(), timeout_s, uuid.uuid4().hex[:8], bar, on_message)
    futures: list[Future | None] = [None] * len(requests)
    try:
        with ThreadPoolExecutor(max_concurrency, thread_name_prefix="replay") as pool:
            try:
                _dispatch(sender, requests, pool, bar, futures)
                for fut in futures:
                    if fut is not None:
                        fut.exception()  # waits; Ctrl-C interrupts this wait
            except KeyboardInterrupt:
                log.warning("interrupted: cancelling in-flight requests")
                sender.stop()
    finally:
        client.close()
        bar.close()
    records = tuple(f.result() if f is not None else sender.cancelled_record(r, "replay stopped before its arrival")
                    for f, r in zip(futures, requests, strict=True))
    run = {"endpoint": endpoint, "max_concurrency": max_concurrency, "timeout_s": timeout_s,
           "interrupted": sender.stopping.is_set(), "started_unix_s": time.time() - sender.now_s()}
    summary = summarize(records, trace=scaled.describe() if scaled else None, run=run)
    paths = tuple(write_report(out_dir, records, summary, plots=plots)) if out_dir is not None else ()
    return LiveResult(records=records, summary=summary, paths=paths)
