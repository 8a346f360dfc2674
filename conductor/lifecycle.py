"""One request's life in the Conductor: ``RequestLife.run`` asks the core for a decision
(``ConductorCore.route``), applies it through a ``Dispatcher`` (reserve, prefill, decode),
reports what it learns through the core's transitions, and yields the client's
``GenerateResponse`` messages (through ``conductor.client_stream``).

It owns the request's placements (each retry and migration is one, with its own
``placement_id``), its deadline (the request's or the client's, whichever is sooner) and
cancellation; what to do about a failure is ``conductor.dispatch``'s pure rules. It yields
exactly one terminal message, or ends with ``Refused`` (nothing reached the client; the
caller reports it) or ``Aborted`` (DEADLINE_EXCEEDED once work began). Steps 2-9 of
docs/architecture.md, "The request lifecycle", describe the behaviour.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

import grpc

from conductor.client_stream import ITL_BATCH_TOKENS, ClientStream  # noqa: F401 - ITL_BATCH_TOKENS: re-exported
from conductor.core import ConductorCore, RequestFacts
from conductor.dispatch import (
    Dispatcher,
    DispatchError,
    FailureKind,
    PrefillCall,
    PrefillResult,
    placement_id,
    prefill_timeout_s,
    should_migrate,
    should_retry,
)
from conductor.metrics import ConductorMetrics
from conductor.routing import Rejection, RejectKind, RouteDecision
from conductor.speed import dispatch_of
from conductor.validation import ValidRequest
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from proto import inference_pb2 as pb
from runtime.logs import Throttled

log = logging.getLogger(__name__)
THROTTLED = Throttled(log)  # failures, retries and migrations: each logged once, bounded under floods
MIN_CALL_TIMEOUT_S = 1e-3  # a worker call's gRPC timeout is what is left of the deadline, at least this


class Aborted(Exception):
    """Ends the call with a gRPC status instead of a terminal message (DEADLINE_EXCEEDED after
    work began); the lifecycle has reported the request's outcome."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Refused(Aborted):
    """Ends a request before anything reached the client with a gRPC status
    (RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED); the caller reports it."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float = 1.0, reason: str = "overload"):
        super().__init__(code, message)
        self.retry_after_s, self.reason = retry_after_s, reason


@dataclass(frozen=True)
class _Loss:
    """Why a decode stream ended without its finish; ``failure`` labels a FAILED outcome."""

    worker: str
    kind: FailureKind
    failure: str
    message: str
    num_sent: int  # tokens the client had when it happened

    def __str__(self) -> str:
        return f"decode worker {self.worker} lost after {self.num_sent} tokens ({self.message})"


Placement = Generator[pb.GenerateResponse, None, "tuple[RouteDecision, PrefillResult] | None"]


class RequestLife:
    """``max_attempts``: tries of a placement (route, reserve, prefill); ``max_migrations``: decode
    workers a request may move to mid-stream (0: none); ``prefill_timeout_s``: the stall floor
    of ``conductor.dispatch.prefill_timeout_s`` (0: none); ``client_deadline_s``: the client's
    gRPC time remaining (None: none), when sooner than the request's ``deadline_s``."""

    def __init__(self, core: ConductorCore, dispatcher: Dispatcher, tokenizer: Tokenizer, req: ValidRequest,
                 request_id: str, seq: int, max_attempts: int, metrics: ConductorMetrics | None = None, *,
                 max_migrations: int = 0, prefill_timeout_s: float = 0.0, client_deadline_s: float | None = None,
                 client_request_id: str = "", live_key: bytes = b""):
        self.core, self.dispatcher, self.tokenizer, self.req = core, dispatcher, tokenizer, req
        self.clock = core.clock
        self.request_id = request_id  # the cluster's id for it (conductor.requests)
        client = client_request_id or request_id
        self.name = f"{req.tenant}/{client}" if req.tenant else client  # what logs call it: the tenant's id
        self.facts = RequestFacts(request_id, seq, req.prompt_ids, req.params.max_new_tokens, req.tenant,
                                  req.ttft_slo_s, req.tbt_slo_s, live_key=live_key)
        self.max_attempts, self.max_migrations, self.prefill_timeout_s = max_attempts, max_migrations, prefill_timeout_s
        by_client = client_deadline_s is not None and client_deadline_s < req.deadline_s
        self.deadline_s = client_deadline_s if by_client else req.deadline_s
        self._deadline_name = "the client's gRPC deadline" if by_client else "deadline_s"
        self.metrics: ConductorMetrics = metrics if metrics is not None else ConductorMetrics.disabled()
        self.out = ClientStream(client_request_id or request_id, req, tokenizer, self.metrics, core.slos, self.clock)
        # The timeline is shared: routed and prefill_start are written here, token times by ``out``.
        self.t, self.tokens = self.out.t, self.out.tokens
        self._base = 0  # tokens sent before the current placement: its prompt is prompt + tokens[:base]
        self._num_resumed = len(req.resumed)  # sent by a Conductor that failed (GenerateRequest.resume)
        if req.resumed:  # placed like a migration: prompt + the tokens sent, the rest of max tokens
            self.out.resume(req.resumed)
            self._base = self._num_resumed
            self.facts = dataclasses.replace(self.facts, prompt_ids=req.prompt_ids + req.resumed,
                                             max_tokens=req.params.max_new_tokens - self._base,
                                             ttft_slo_s=math.inf, tbt_slo_s=math.inf)
        self._lost: set[str] = set()  # decode workers lost mid-stream, never used again
        self._num_migrations = 0
        self._placements = 0  # placements tried so far (each retry and migration is one)
        self._worker_rid = request_id  # the current placement's id on the workers (placement_id)
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
        """Seconds left of the deadline (negative once past)."""
        return self.deadline_s - (self.clock.now() - self.t.arrival)

    def _call_timeout_s(self) -> float:
        return max(MIN_CALL_TIMEOUT_S, self._left_s())

    # ---- the lifecycle ----------------------------------------------------------------------
    def run(self) -> Iterator[pb.GenerateResponse]:
        try:
            yield from self._run()
        except Refused:
            self.out.ended = True  # refused before any work: the caller reports it (ConductorMetrics.refused)
            raise
        finally:
            self.core.finished(self.request_id)
            if not self.out.ended:  # the client went away before the terminal message was made
                self.out.report("cancelled", "client_gone")

    def _run(self) -> Iterator[pb.GenerateResponse]:
        finish = self._finish_of_sent() if self._num_resumed else 0
        if finish:  # a failed Conductor sent the last token, and the call broke before its finish
            yield self._terminal(finish)
            return
        placed = yield from self._place(self.facts, self.req.params)
        if placed is None:
            return
        decision, result = placed
        yield self.out.first(decision, result)
        yield from self._stream(decision, result.first_token)

    def _stream(self, decision: RouteDecision, first_token: int) -> Iterator[pb.GenerateResponse]:
        """From a placement's first token to the terminal message, across migrations."""
        while True:
            finish = self._finish_of_sent()
            if finish:  # the prefill's token ended the request: its reservation is never decoded
                self.dispatcher.release(decision.decode_worker, self._worker_rid)
                yield self._terminal(finish)
                return
            loss = yield from self._forward(decision, first_token)
            if loss is None:
                return
            finish = self._finish_of_sent()
            if finish:  # the last token arrived, the stream broke before its finish
                yield self._terminal(finish)
                return
            placed = yield from self._migrate(loss)
            if placed is None:
                return
            decision, result = placed
            first_token = result.first_token
            yield self._more((first_token,), decode_worker=decision.decode_worker)

    @property
    def _started(self) -> bool:
        """Whether this Conductor has sent the client a token of this request."""
        return len(self.tokens) > self._num_resumed

    def _finish_of_sent(self) -> int:
        """STOP or LENGTH when the last token sent ends the request (as the decode worker decides), else 0."""
        params = self.req.params
        if self.tokens[-1] in params.stop_token_ids:
            return pb.FINISH_REASON_STOP
        return pb.FINISH_REASON_LENGTH if len(self.tokens) >= params.max_new_tokens else 0

    # ---- placing: route, reserve, prefill (with retries) ---------------------------------------
    def _place(self, facts: RequestFacts, params: SamplingParams, loss: _Loss | None = None) -> Placement:
        """Route, reserve and prefill ``facts``, again elsewhere while ``should_retry`` allows;
        (decision, result), or None after a terminal message. ``loss``: what a migration
        replaces (tokens were sent), named first in the error of a FAILED terminal."""
        avoid = list(self._lost)  # the workers to route around, the one that failed longest ago first
        why = str(loss) if loss is not None else ""
        attempt = 0
        while True:
            if self.cancelled:  # the client left before this placement: nothing is reserved for it
                return None
            attempt += 1
            routed, keys = self._route(facts, avoid)
            if isinstance(routed, Rejection) or routed.decode_worker in self._lost:
                # Only while migrating: before any token a rejection is Refused (_route), and
                # no worker is lost. The core falls back to avoided workers when none is left.
                assert loss is not None
                self.core.finished(self.request_id)
                left = routed.reason if isinstance(routed, Rejection) else "no other decode worker to continue on"
                yield self._terminal(pb.FINISH_REASON_FAILED, f"{why}; {left}", loss.failure)
                return None
            try:
                result = self._reserve_and_prefill(facts, params, routed, keys)
            except DispatchError as e:
                self.core.finished(self.request_id)
                if e.kind is FailureKind.DEADLINE and not self.cancelled:
                    raise self._deadline(self._passed(e), at_routing=False) from e
                if not should_retry(e.kind, attempt, self.max_attempts, self.cancelled):
                    reason = pb.FINISH_REASON_CANCELLED if self.cancelled else pb.FINISH_REASON_FAILED
                    yield self._terminal(reason, f"{why}; {e}" if why else str(e), e.kind.value)
                    return None
                # Nothing of this placement reached the client and no partial cache is kept:
                # route again, away from the workers that failed, and recompute.
                THROTTLED.log(logging.WARNING, "retry", "request %s: %s; retrying elsewhere (attempt %d of %d)",
                              self.name, e, attempt + 1, self.max_attempts)
                self.metrics.retried(e.kind.value)
                # Blame the worker the call failed on; a failed KV push, either end.
                blamed = ((routed.prefill_worker, routed.decode_worker) if e.kind is FailureKind.TRANSFER
                          else (e.worker_id,))
                avoid = [w for w in avoid if w not in blamed] + list(blamed)
                continue
            self._prefilled(routed, result)
            return routed, result

    def _route(self, facts: RequestFacts, avoid: list[str]) -> tuple[RouteDecision | Rejection, tuple[bytes, ...]]:
        """The core's decision and the prompt's block keys, or a rejection while migrating;
        before any token a rejection raises ``Refused``, and a decision whose predicted TTFT is
        past the deadline raises DEADLINE_EXCEEDED (``_deadline``)."""
        if self._left_s() <= 0:
            raise self._deadline(f"{self._deadline_name} ({self.deadline_s:g} s) passed before routing",
                                 at_routing=True)
        routed = self.core.route(facts, tuple(avoid))
        self.t.routed = self.clock.now()
        outcome = routed.outcome
        self.metrics.routed(outcome.branch.value if isinstance(outcome, RouteDecision) else "rejected")
        if isinstance(outcome, Rejection):
            if self._started:
                return outcome, routed.keys
            # No workers of a role is a service that is not up yet, not an overload.
            unavailable = outcome.kind is RejectKind.NO_WORKERS
            code = grpc.StatusCode.UNAVAILABLE if unavailable else grpc.StatusCode.RESOURCE_EXHAUSTED
            raise Refused(code, outcome.reason, outcome.retry_after_s, outcome.kind.value)
        if not self._started:
            self.out.predicted = outcome.predicted
            if routed.snapshot is not None:
                source = routed.snapshot.find(outcome.reuse.holder or outcome.prefill_worker)
                tier = source.usable_tier if source is not None else None
                self.out.cached_tier = tier.name.lower() if tier is not None else "unknown"
        left_s = self._left_s()
        if outcome.predicted.ttft_s > left_s:
            self.core.finished(self.request_id)
            raise self._deadline(f"the predicted time to first token ({outcome.predicted.ttft_s:.2f} s on "
                                 f"{outcome.prefill_worker}) exceeds the {max(0.0, left_s):.2f} s left of "
                                 f"{self._deadline_name} ({self.deadline_s:g} s)", at_routing=True)
        return outcome, routed.keys

    def _reserve_and_prefill(self, facts: RequestFacts, params: SamplingParams, decision: RouteDecision,
                             keys: tuple[bytes, ...]) -> PrefillResult:
        d = decision.decode_worker
        rid = self._worker_rid = placement_id(self.request_id, self._placements)
        self._placements += 1
        try:
            address = self.dispatcher.reserve(d, rid, facts.prompt_len, facts.max_tokens, self._call_timeout_s())
        except DispatchError as e:
            if e.kind is FailureKind.BUSY and not self.cancelled and not self._started:
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), 1.0, "decode_full") from e
            raise
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self.dispatcher.release(d, rid)

        self._on_cancel(release)
        timeout_s = prefill_timeout_s(self.prefill_timeout_s, decision.predicted.ttft_s)
        call = PrefillCall(rid, facts.prompt_ids, params, keys, decision.reuse.num_blocks, address,
                           self._call_timeout_s(), decision.reuse.holder or "", timeout_s=timeout_s,
                           cpp_chunk_tokens=decision.cpp_chunk_tokens)
        if not self._started:
            self.t.prefill_start = self.clock.now()
        try:
            return self.dispatcher.prefill(decision.prefill_worker, call, self._on_cancel)
        except DispatchError:
            release()
            raise

    def _prefilled(self, decision: RouteDecision, result: PrefillResult) -> None:
        """What every placement's first token tells the core: the prefill is done, its blocks
        are stored, and how fast the worker was against the prediction."""
        routed_to_first_s = self.clock.now() - self.t.routed
        self.core.prefilled(self.request_id, decision.prefill_worker, decision.predicted.model_prefill_s,
                            result.prefill_s, result.events, handoff_s=result.handoff_s,
                            dispatch_s=dispatch_of(routed_to_first_s, result.queue_s, result.prefill_s))
        self.metrics.prediction(decision.predicted.ttft_s, routed_to_first_s)

    # ---- decoding and migrating --------------------------------------------------------------
    def _forward(self, decision: RouteDecision, first: int) -> Generator[pb.GenerateResponse, None, _Loss | None]:
        """Forward the decode worker's tokens; None once a terminal message was yielded, else
        what ended the stream before its finish."""
        d = decision.decode_worker
        self.core.decoding(self.request_id)
        num_prompt = len(self.req.prompt_ids) + self._base
        chunks = self.dispatcher.decode(d, self._worker_rid, first, self._params(), num_prompt, self._call_timeout_s(),
                                        self._on_cancel)
        try:
            for chunk in chunks:
                if chunk.token_ids:
                    yield self._more(chunk.token_ids)
                if chunk.finish_reason == pb.FINISH_REASON_FAILED:
                    return _Loss(d, FailureKind.INTERNAL, "decode_worker", "the decode worker failed the request",
                                 len(self.tokens))
                if chunk.finish_reason:
                    yield self._terminal(chunk.finish_reason, failure="decode_worker")
                    return None
            return _Loss(d, FailureKind.UNAVAILABLE, "decode_stream", "decode stream ended early", len(self.tokens))
        except DispatchError as e:
            if self.cancelled:
                yield self._terminal(pb.FINISH_REASON_CANCELLED, str(e), e.kind.value)
                return None
            if e.kind is FailureKind.DEADLINE:
                raise self._deadline(self._passed(e), at_routing=False) from e
            return _Loss(d, e.kind, e.kind.value, str(e), len(self.tokens))

    def _migrate(self, loss: _Loss) -> Placement:
        """Place the request again as prompt + the tokens sent, on another decode worker;
        (decision, result), or None after a terminal message (FAILED with the reason)."""
        self._lost.add(loss.worker)
        self.core.finished(self.request_id)
        if not should_migrate(loss.kind, self._num_migrations, self.max_migrations, self.cancelled):
            reason = pb.FINISH_REASON_CANCELLED if self.cancelled else pb.FINISH_REASON_FAILED
            more = f"; no migrations left ({self.max_migrations} allowed)" if self.max_migrations else ""
            yield self._terminal(reason, f"{loss}{more}", loss.failure)
            return None
        self._num_migrations += 1
        self._base = len(self.tokens)
        # The SLOs were the first token's; a continuation is never refused for them, only for
        # the deadline (``_route``).
        facts = dataclasses.replace(self.facts, prompt_ids=self.req.prompt_ids + tuple(self.tokens),
                                    max_tokens=self.req.params.max_new_tokens - self._base,
                                    ttft_slo_s=math.inf, tbt_slo_s=math.inf)
        placed = yield from self._place(facts, self._params(), loss)
        if placed is not None:
            self.metrics.migrated(loss.failure)
            THROTTLED.log(logging.WARNING, "migration",
                          "request %s: %s; continuing on decode worker %s (migration %d of %d)", self.name,
                          loss, placed[0].decode_worker, self._num_migrations, self.max_migrations)
        return placed

    def _params(self) -> SamplingParams:
        """The current placement's sampling: what is left of max tokens."""
        if not self._base:
            return self.req.params
        return dataclasses.replace(self.req.params, max_new_tokens=self.req.params.max_new_tokens - self._base)

    def _passed(self, e: DispatchError) -> str:
        return f"{self._deadline_name} ({self.deadline_s:g} s) passed ({e})"

    def _deadline(self, message: str, at_routing: bool) -> Aborted:
        """DEADLINE_EXCEEDED: ``Refused`` at routing before any token, else ``Aborted`` (reported here)."""
        message = f"request {self.name}: {message}"
        if at_routing and not self._started:
            return Refused(grpc.StatusCode.DEADLINE_EXCEEDED, message, 0.0, "deadline")
        THROTTLED.log(logging.WARNING, "deadline", "%s after %d tokens", message, len(self.tokens))
        self.out.report("failed", "deadline")
        return Aborted(grpc.StatusCode.DEADLINE_EXCEEDED, message)

    def _more(self, token_ids: tuple[int, ...], decode_worker: str = "") -> pb.GenerateResponse:
        msg = self.out.more(token_ids, decode_worker)
        self.core.generated(self.request_id, len(self.tokens) - self._base)
        return msg

    def _terminal(self, reason: int, error: str = "", failure: str = "") -> pb.GenerateResponse:
        if error:
            THROTTLED.log(logging.WARNING, f"ended:{reason}", "request %s ended %s after %d tokens: %s",
                          self.name, pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_"),
                          len(self.tokens), error)
        return self.out.terminal(reason, error, failure)
