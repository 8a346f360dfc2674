"""One request's life in the Conductor (docs/architecture.md, steps 2-9): decide, then apply.

``RequestLife.run`` is a generator of ``GenerateResponse`` messages. It asks the core for a
frozen decision (``ConductorCore.route``), then applies it through a ``Dispatcher``: reserve
on the decode worker, prefill (which streams KV to the decode worker and returns the first
token), then forward the decode worker's tokens. A reservation or prefill that fails before
anything reached the client is routed again, away from the workers involved, while the pure
``should_retry`` allows it. It yields exactly one terminal message (finish reason set)
unless the request is refused before any work (``Refused``: the caller aborts with a
status). Cancellation (client gone) cancels the in-flight worker calls and releases the
reservation. Every path leaves the pending overlay (``finally``). Time comes from the core's
injected clock.

Metrics (``records.metrics``, ``conductor.metrics``): each routing decision, the first token
(TTFT, queue time, prompt and cached tokens), every later token (inter-token latency) and
exactly one outcome per request that is not ``Refused`` (the caller reports those): the
terminal message's, or ``cancelled``/``client_gone`` when the client left before it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from conductor.core import ConductorCore, RequestFacts
from conductor.dispatch import Dispatcher, DispatchError, FailureKind, PrefillCall, PrefillResult, should_retry
from conductor.metrics import ConductorMetrics
from conductor.records import RequestRecords
from conductor.routing import Rejection, RejectKind, RouteDecision
from conductor.validation import ValidRequest
from engine.tokenizer import Tokenizer
from proto import inference_pb2 as pb
from proto.convert import FINISH_CODES

log = logging.getLogger(__name__)
ITL_BATCH_TOKENS = 16  # token intervals handed to the metrics at once (and at the end of a request)


class Refused(Exception):
    """Ends a request before any work with a gRPC status (RESOURCE_EXHAUSTED, UNAVAILABLE)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float = 1.0, reason: str = "overload"):
        super().__init__(message)
        self.code, self.retry_after_s, self.reason = code, retry_after_s, reason


@dataclass
class _Timeline:
    arrival: float
    routed: float = 0.0
    prefill_start: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    intervals: list[float] = field(default_factory=list)  # seconds between tokens sent, for the TBT SLO


class RequestLife:
    def __init__(self, core: ConductorCore, dispatcher: Dispatcher, tokenizer: Tokenizer, req: ValidRequest,
                 request_id: str, seq: int, max_attempts: int, records: RequestRecords | None = None):
        self.core, self.dispatcher, self.tokenizer, self.req = core, dispatcher, tokenizer, req
        self.clock = core.clock
        self.request_id = request_id
        self.facts = RequestFacts(request_id, seq, req.prompt_ids, req.params.max_new_tokens, req.tenant,
                                  req.ttft_slo_s, req.tbt_slo_s)
        self.max_attempts = max_attempts
        self.records = records
        self.metrics: ConductorMetrics = records.metrics if records is not None else ConductorMetrics.disabled()
        self.t = _Timeline(self.clock.now())
        self._ended = False  # an outcome was reported to the metrics (or the caller reports it)
        self._cached_tier = "unknown"
        self._num_sent = 0
        self._unreported = 0  # token intervals at the end of t.intervals not yet given to the metrics
        self._cancel_hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.cancelled = False

    def cancel(self) -> None:
        """Client went away: stop worker calls and free the decode reservation. Idempotent."""
        with self._lock:
            self.cancelled = True
            hooks, self._cancel_hooks = self._cancel_hooks, []
        for hook in hooks:
            hook()

    def _on_cancel(self, hook: Callable[[], None]) -> None:
        with self._lock:
            if not self.cancelled:
                self._cancel_hooks.append(hook)
                return
        hook()

    def _left_s(self) -> float:
        return max(0.1, self.req.deadline_s - (self.clock.now() - self.t.arrival))

    # ---- the lifecycle ----------------------------------------------------------------------
    def run(self) -> Iterator[pb.GenerateResponse]:
        try:
            yield from self._run()
        except Refused:
            self._ended = True  # refused before any work: the caller reports it (RequestRecords.count)
            raise
        finally:
            self.core.pending.finish(self.request_id, self.clock.now())
            if not self._ended:  # the client went away before the terminal message was made
                self._report("cancelled", "client_gone", self._num_sent)

    def _run(self) -> Iterator[pb.GenerateResponse]:
        avoid: set[str] = set()
        for attempt in range(1, self.max_attempts + 1):
            decision, keys = self._route(avoid)
            try:
                result = self._reserve_and_prefill(decision, keys)
                break
            except DispatchError as e:
                self.core.pending.finish(self.request_id, self.clock.now())
                if should_retry(e.kind, attempt, self.max_attempts, self.cancelled):
                    # Nothing reached the client yet and no partial cache is kept: route again,
                    # away from the workers that failed, and recompute.
                    log.warning("request %s: %s; retrying elsewhere (attempt %d of %d)", self.request_id, e,
                                attempt + 1, self.max_attempts)
                    avoid.update((decision.prefill_worker, decision.decode_worker))
                    continue
                reason = pb.FINISH_REASON_CANCELLED if self.cancelled else pb.FINISH_REASON_FAILED
                yield self._terminal(reason, [], 0, decision, error=str(e), failure=e.kind.value)
                return
        self.t.first_token = self.clock.now()
        self.core.pending.prefill_done(self.request_id, self.t.first_token)
        self.core.cluster.apply_events(result.events)
        self.core.speed.observe(decision.prefill_worker, decision.predicted.prefill_s, result.prefill_s)
        if self.records is not None:
            self.records.prediction(decision.predicted.ttft_s, self.t.first_token - self.t.routed)
        self.t.last_token, self._num_sent = self.t.first_token, 1
        self.metrics.first_token(self.req.tenant, self.t.first_token - self.t.arrival,
                                 self.t.prefill_start - self.t.arrival, len(self.req.prompt_ids), result.cached_tokens,
                                 self._cached_tier)
        tokens = [result.first_token]
        yield self._first(decision, result)
        params = self.req.params
        if result.first_token in params.stop_token_ids or params.max_new_tokens == 1:
            self.dispatcher.release(decision.decode_worker, self.request_id)
            reason = pb.FINISH_REASON_STOP if result.first_token in params.stop_token_ids else pb.FINISH_REASON_LENGTH
            yield self._terminal(reason, tokens, result.cached_tokens, decision)
            return
        yield from self._decode(decision, result.first_token, tokens, result.cached_tokens)

    def _route(self, avoid: set[str]) -> tuple[RouteDecision, tuple[bytes, ...]]:
        routed = self.core.route(self.facts, frozenset(avoid))
        self.t.routed = self.clock.now()
        outcome = routed.outcome
        self.metrics.routed(outcome.branch.value if isinstance(outcome, RouteDecision) else "rejected")
        if isinstance(outcome, RouteDecision) and routed.snapshot is not None:
            source = routed.snapshot.find(outcome.reuse.holder or outcome.prefill_worker)
            tier = source.usable_tier if source is not None else None
            self._cached_tier = tier.name.lower() if tier is not None else "unknown"
        if isinstance(routed.outcome, Rejection):
            rej = routed.outcome
            # No workers of a role is a service that is not up yet, not an overload.
            unavailable = rej.kind is RejectKind.NO_WORKERS
            code = grpc.StatusCode.UNAVAILABLE if unavailable else grpc.StatusCode.RESOURCE_EXHAUSTED
            raise Refused(code, rej.reason, rej.retry_after_s, rej.kind.value)
        return routed.outcome, routed.keys

    def _reserve_and_prefill(self, decision: RouteDecision, keys: tuple[bytes, ...]) -> PrefillResult:
        d = decision.decode_worker
        try:
            address = self.dispatcher.reserve(d, self.request_id, len(self.req.prompt_ids),
                                              self.req.params.max_new_tokens, self._left_s())
        except DispatchError as e:
            if e.kind is FailureKind.BUSY and not self.cancelled:
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), 1.0, "decode_full") from e
            raise
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self.dispatcher.release(d, self.request_id)

        self._on_cancel(release)
        call = PrefillCall(self.request_id, self.req.prompt_ids, keys, decision.reuse.num_blocks,
                           decision.reuse.holder, address, self._left_s())
        self.t.prefill_start = self.clock.now()
        try:
            return self.dispatcher.prefill(decision.prefill_worker, call, self.req.params, self._on_cancel)
        except DispatchError:
            release()
            raise

    def _first(self, decision: RouteDecision, result: PrefillResult) -> pb.GenerateResponse:
        tokens = [result.first_token]
        usage = pb.Usage(prompt_tokens=len(self.req.prompt_ids), cached_tokens=result.cached_tokens,
                         completion_tokens=1)
        return pb.GenerateResponse(request_id=self.request_id, token_ids=tokens, text=self.tokenizer.decode(tokens),
                                   usage=usage, prefill_worker=decision.prefill_worker,
                                   decode_worker=decision.decode_worker, pulled_from=decision.reuse.holder or "",
                                   route_branch=decision.branch.value)

    def _decode(self, decision: RouteDecision, first: int, tokens: list[int],
                cached: int) -> Iterator[pb.GenerateResponse]:
        self.core.pending.decode_started(self.request_id, self.clock.now())
        sent_text = self.tokenizer.decode(tokens)
        chunks = self.dispatcher.decode(decision.decode_worker, self.request_id, first, self.req.params,
                                        len(self.req.prompt_ids), self._left_s(), self._on_cancel)
        try:
            for chunk in chunks:
                if chunk.token_ids:
                    self._sent(len(chunk.token_ids))
                    tokens.extend(chunk.token_ids)
                    self.core.pending.generated(self.request_id, len(tokens))
                    text = self.tokenizer.decode(tokens)
                    yield pb.GenerateResponse(request_id=self.request_id, token_ids=chunk.token_ids,
                                              text=text[len(sent_text):])
                    sent_text = text
                if chunk.finish_reason:
                    yield self._terminal(FINISH_CODES[chunk.finish_reason], tokens, cached, decision,
                                         failure="decode_worker")
                    return
            yield self._terminal(pb.FINISH_REASON_FAILED, tokens, cached, decision, error="decode stream ended early",
                                 failure="decode_stream")
        except DispatchError as e:
            reason = pb.FINISH_REASON_CANCELLED if self.cancelled else pb.FINISH_REASON_FAILED
            yield self._terminal(reason, tokens, cached, decision, error=str(e), failure=e.kind.value)

    def _sent(self, num_tokens: int) -> None:
        now = self.clock.now()
        interval_s, self.t.last_token = now - self.t.last_token, now
        self.t.intervals.extend([interval_s / num_tokens] * num_tokens)
        self._num_sent += num_tokens
        self._unreported += num_tokens
        if self._unreported >= ITL_BATCH_TOKENS:
            self._report_tokens()

    def _report_tokens(self) -> None:
        if self._unreported:
            self.metrics.tokens(self.req.tenant, self.t.intervals[-self._unreported:])
            self._unreported = 0

    def _report(self, outcome: str, failure: str, num_generated: int) -> None:
        """The request's one outcome for the metrics; ``within_slo`` as Mooncake's goodput counts
        it: TTFT within its SLO and TBT (mean of the slowest 10% of token intervals) within its."""
        self._ended = True
        self._report_tokens()
        slo = self.core.slos.resolve(self.req.tenant, self.req.ttft_slo_s, self.req.tbt_slo_s)
        slowest = sorted(self.t.intervals, reverse=True)[: max(1, len(self.t.intervals) // 10)]
        tbt_s = sum(slowest) / len(slowest) if slowest else 0.0
        ttft_s = self.t.first_token - self.t.arrival if self.t.first_token else float("inf")
        self.metrics.ended(self.req.tenant, outcome, failure, len(self.req.prompt_ids), num_generated,
                           self.clock.now() - self.t.arrival, ttft_s <= slo.ttft_s and tbt_s <= slo.tbt_s)

    def _terminal(self, reason: int, tokens: list[int], cached: int, decision: RouteDecision,
                  error: str = "", failure: str = "") -> pb.GenerateResponse:
        """The terminal message; ``failure`` (a failure kind) labels a FAILED outcome's reason."""
        outcome = pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
        self._report(outcome, failure if outcome == "failed" else ("client" if outcome == "cancelled" else ""),
                     len(tokens))
        now = self.clock.now()
        decode_s = now - self.t.first_token if self.t.first_token else 0.0
        timing = pb.Timing(
            queue_s=(self.t.prefill_start or now) - self.t.arrival,
            ttft_s=(self.t.first_token - self.t.arrival) if self.t.first_token else 0.0,
            total_s=now - self.t.arrival,
            decode_tokens_per_s=(len(tokens) - 1) / decode_s if decode_s > 0 and len(tokens) > 1 else 0.0,
            predicted_ttft_s=decision.predicted.ttft_s, predicted_tbt_s=decision.predicted.tbt_s,
        )
        usage = pb.Usage(prompt_tokens=len(self.req.prompt_ids), cached_tokens=cached, completion_tokens=len(tokens))
        if error:
            log.warning("request %s: %s", self.request_id, error)
        return pb.GenerateResponse(request_id=self.request_id, finish_reason=reason, usage=usage, timing=timing,
                                   error=error)
