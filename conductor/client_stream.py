"""What one request's client and the metrics see of it: the tokens sent, in order, with their
text deltas (``engine.detokenizer``: O(delta) per message, a character split across tokens
held back until it is whole, the rest flushed with the terminal message); the first and the
terminal message (usage and timing); the token intervals and the request's one outcome for
``conductor.metrics``.

``ClientStream`` is written by the request's lifecycle (``conductor.lifecycle``) on one
thread; it knows nothing of workers or routing beyond the names the first message carries.
Across a migration the stream simply goes on: usage counts the original prompt and every
token sent, and the interval before a continuation's first token is the gap the client saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conductor.clock import Clock
from conductor.config import SLOTable
from conductor.metrics import ConductorMetrics
from conductor.routing import Prediction, RouteDecision
from conductor.validation import ValidRequest
from engine.detokenizer import Detokenizer
from engine.tokenizer import Tokenizer
from proto import inference_pb2 as pb
from runtime.calls import PrefillResult

ITL_BATCH_TOKENS = 16  # token intervals handed to the metrics at once (and at the end of a request)


@dataclass
class StreamTimes:
    arrival: float
    routed: float = 0.0
    prefill_start: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    intervals: list[float] = field(default_factory=list)  # seconds between tokens sent, for the TBT SLO


class ClientStream:
    def __init__(self, request_id: str, req: ValidRequest, tokenizer: Tokenizer, metrics: ConductorMetrics,
                 slos: SLOTable, clock: Clock):
        self.request_id, self.req, self.tokenizer, self.metrics, self.slos, self.clock = (
            request_id, req, tokenizer, metrics, slos, clock)
        self.t = StreamTimes(clock.now())
        self.tokens: list[int] = []  # every token sent, in order
        self.ended = False  # the outcome was reported (or the caller reports it)
        self.cached_tier = "unknown"  # where the first prefill's reused prefix came from
        self.predicted = Prediction()  # of the decision that made (or tried to make) the first token
        self._first_prefill: PrefillResult | None = None  # the prefill that made the first token
        self._detok = Detokenizer(tokenizer)
        self._unreported = 0  # token intervals at the end of t.intervals not yet given to the metrics

    def resume(self, tokens: tuple[int, ...]) -> None:
        """The stream goes on after ``tokens``, which a Conductor that failed already sent: they
        count as sent (usage, max tokens) and their text as shown (``GenerateRequest.resume``)."""
        self.tokens.extend(tokens)
        self._detok.push(tokens)

    def first(self, decision: RouteDecision, result: PrefillResult) -> pb.GenerateResponse:
        """The first token's message (TTFT); names the workers and the route."""
        self.t.first_token = self.t.last_token = self.clock.now()
        self._first_prefill = result
        self.metrics.first_token(self.req.tenant, self.t.first_token - self.t.arrival,
                                 self.t.prefill_start - self.t.arrival, len(self.req.prompt_ids), result.cached_tokens,
                                 self.cached_tier)
        self.tokens.append(result.first_token)
        text = self._detok.push((result.first_token,))
        usage = pb.Usage(prompt_tokens=len(self.req.prompt_ids), cached_tokens=result.cached_tokens,
                         completion_tokens=len(self.tokens), loaded_cached_tokens=result.loaded_tokens)
        return pb.GenerateResponse(request_id=self.request_id, token_ids=(result.first_token,), text=text,
                                   usage=usage, prefill_worker=decision.prefill_worker,
                                   decode_worker=decision.decode_worker, pulled_from=decision.reuse.holder or "",
                                   route_branch=decision.branch.value)

    def more(self, token_ids: tuple[int, ...], decode_worker: str = "") -> pb.GenerateResponse:
        """Tokens after the first, with their text delta; ``decode_worker``: set on a migration's
        first token, the worker the stream goes on from."""
        now = self.clock.now()
        interval_s, self.t.last_token = now - self.t.last_token, now
        self.t.intervals.extend([interval_s / len(token_ids)] * len(token_ids))
        self._unreported += len(token_ids)
        if self._unreported >= ITL_BATCH_TOKENS:
            self._report_tokens()
        self.tokens.extend(token_ids)
        return pb.GenerateResponse(request_id=self.request_id, token_ids=token_ids, text=self._detok.push(token_ids),
                                   decode_worker=decode_worker)

    def terminal(self, reason: int, error: str = "", failure: str = "") -> pb.GenerateResponse:
        """The terminal message, and the outcome; ``failure`` (a failure kind) labels a FAILED
        outcome's reason."""
        tokens = self.tokens
        outcome = pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
        self.report(outcome, failure if outcome == "failed" else ("client" if outcome == "cancelled" else ""))
        now, t, first = self.clock.now(), self.t, self._first_prefill
        decode_s = now - t.first_token if t.first_token else 0.0
        timing = pb.Timing(
            queue_s=(t.prefill_start or now) - t.arrival,
            ttft_s=(t.first_token - t.arrival) if t.first_token else 0.0,
            total_s=now - t.arrival,
            decode_tokens_per_s=(len(tokens) - 1) / decode_s if decode_s > 0 and len(tokens) > 1 else 0.0,
            predicted_ttft_s=self.predicted.ttft_s, predicted_tbt_s=self.predicted.tbt_s,
            predicted_queue_s=self.predicted.queue_s, predicted_transfer_s=self.predicted.transfer_s,
            predicted_prefill_s=self.predicted.prefill_s, predicted_slowdown=self.predicted.slowdown,
            predicted_dispatch_s=self.predicted.dispatch_s,
            prefill_worker_s=first.prefill_s if first else 0.0,
        )
        usage = pb.Usage(prompt_tokens=len(self.req.prompt_ids), cached_tokens=first.cached_tokens if first else 0,
                         completion_tokens=len(tokens), loaded_cached_tokens=first.loaded_tokens if first else 0)
        return pb.GenerateResponse(request_id=self.request_id, finish_reason=reason, usage=usage, timing=timing,
                                   error=error, text=self._detok.flush())

    def report(self, outcome: str, failure: str) -> None:
        """The request's one outcome for the metrics; ``within_slo`` as Mooncake's goodput counts
        it: TTFT within its SLO and TBT (mean of the slowest 10% of token intervals) within its."""
        self.ended = True
        self._report_tokens()
        slo = self.slos.resolve(self.req.tenant, self.req.ttft_slo_s, self.req.tbt_slo_s)
        t = self.t
        slowest = sorted(t.intervals, reverse=True)[: max(1, len(t.intervals) // 10)]
        tbt_s = sum(slowest) / len(slowest) if slowest else 0.0
        ttft_s = t.first_token - t.arrival if t.first_token else float("inf")
        self.metrics.ended(self.req.tenant, outcome, failure, len(self.req.prompt_ids), len(self.tokens),
                           self.clock.now() - t.arrival, ttft_s <= slo.ttft_s and tbt_s <= slo.tbt_s)

    def _report_tokens(self) -> None:
        if self._unreported:
            self.metrics.tokens(self.req.tenant, self.t.intervals[-self._unreported:])
            self._unreported = 0
