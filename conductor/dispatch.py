"""The ``Dispatcher`` protocol: how the request lifecycle applies a routing decision.

The lifecycle decides (``conductor.core``), then hands each step to a dispatcher: reserve on
the decode worker, prefill (which pulls the planned prefix from its holder when the plan
names one, and streams KV to the decode worker), decode, release. The live Conductor's
dispatcher speaks gRPC (``conductor.grpc_dispatch``). The simulator has no dispatcher: its
event-driven workers (``replay.sim``) apply the decision and report through the same core
transitions. A step that fails raises ``DispatchError`` with a typed ``FailureKind``. What
the lifecycle does about a failure is decided here by pure rules: ``should_retry`` (route a
failed prefill again elsewhere), ``should_migrate`` (move a request whose decode worker was
lost mid-stream) and ``prefill_timeout_s`` (how long one prefill attempt may go unanswered
before it counts as stalled).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from engine.sampling_params import SamplingParams
from runtime.calls import PrefillCall, PrefillResult  # noqa: F401 - re-exported: the Dispatcher's values


class FailureKind(enum.StrEnum):
    UNAVAILABLE = "unavailable"  # the worker died, is unreachable or is draining
    BUSY = "busy"  # the worker had no room for the request
    TRANSFER = "transfer"  # the KV transfer failed (checksum, truncation, dead peer)
    DEADLINE = "deadline"  # the request's deadline passed
    CANCELLED = "cancelled"  # the client went away
    REFUSED = "refused"  # the worker refused the call as malformed or out of order
    INTERNAL = "internal"  # anything else
    STALLED = "stalled"  # no answer within the attempt's own bound (a hung worker), before the deadline


RETRYABLE = frozenset({FailureKind.UNAVAILABLE, FailureKind.BUSY, FailureKind.TRANSFER, FailureKind.STALLED})
# A decode stream broken by the worker (it died, is unreachable, or failed the request itself);
# not by the request (its deadline, the client leaving, a call out of order).
MIGRATABLE = frozenset({FailureKind.UNAVAILABLE, FailureKind.TRANSFER, FailureKind.INTERNAL, FailureKind.STALLED})
# A prefill attempt may take this many times the policy's predicted TTFT before it counts as
# stalled. The prediction (mooncake's) already holds the queue the request joined and the
# worker's observed slowdown (conductor.speed), so a working worker stays well inside it; one
# that takes four times as long has most likely stopped.
STALL_SLACK = 4.0


class DispatchError(Exception):
    def __init__(self, kind: FailureKind, worker_id: str, message: str):
        super().__init__(f"{worker_id}: {message}")
        self.kind, self.worker_id, self.message = kind, worker_id, message


def should_retry(kind: FailureKind, attempt: int, max_attempts: int, cancelled: bool) -> bool:
    """Route a failed prefill again, away from the workers involved? Only while nothing has
    reached the client (the caller's contract), the client is still there, attempts remain,
    and the failure is one that another worker may not have."""
    return not cancelled and attempt < max_attempts and kind in RETRYABLE


def should_migrate(kind: FailureKind, num_migrations: int, max_migrations: int, cancelled: bool) -> bool:
    """Move a request whose decode stream broke mid-way to another decode worker (prefilling
    prompt + the tokens already sent)? While the client is still there, migrations remain
    (``num_migrations`` done so far), and the worker broke the stream, not the request."""
    return not cancelled and num_migrations < max_migrations and kind in MIGRATABLE


def prefill_timeout_s(floor_s: float, predicted_ttft_s: float) -> float:
    """Seconds one prefill attempt may go unanswered before it is cancelled as ``STALLED`` and
    retried elsewhere: ``max(floor_s, STALL_SLACK * predicted_ttft_s)`` (a policy that predicts
    nothing gives 0: the floor alone); ``math.inf`` when ``floor_s`` is 0 (only the request's
    deadline bounds it). The caller caps it at the deadline."""
    if floor_s < 0 or predicted_ttft_s < 0:
        raise ValueError(f"prefill_timeout_s: floor_s {floor_s} and predicted_ttft_s {predicted_ttft_s} must be >= 0")
    return max(floor_s, STALL_SLACK * predicted_ttft_s) if floor_s > 0 else math.inf


def placement_id(request_id: str, placement: int) -> str:
    """The id a request's ``placement``-th placement (0: the first; then each retry or
    migration) goes by on the workers. A distinct id per placement means frames of an earlier,
    abandoned prefill (a stalled worker that resumes) can never land in a later reservation.
    '/' never occurs in a request id (``conductor.validation``)."""
    return request_id if placement == 0 else f"{request_id}/{placement}"


def request_of(placement_id: str) -> str:
    """The request a worker-side id (``placement_id``) belongs to."""
    return placement_id.split("/", 1)[0]


@dataclass(frozen=True)
class DecodeChunk:
    token_ids: tuple[int, ...]
    finish_reason: int = 0  # a FinishReason (pb.FINISH_REASON_*), as the worker sent it; 0 until the end


CancelHook = Callable[[Callable[[], None]], None]


class Dispatcher(Protocol):
    """Each method may raise ``DispatchError``; ``on_cancel(hook)`` registers a hook that
    aborts the step when the client goes away."""

    def reserve(self, decode_worker: str, request_id: str, num_prompt_tokens: int, max_tokens: int,
                deadline_s: float) -> str:
        """Reserve pages for prompt + max tokens; returns the decode worker's transfer address."""

    def prefill(self, prefill_worker: str, call: PrefillCall, on_cancel: CancelHook) -> PrefillResult: ...

    def decode(self, decode_worker: str, request_id: str, first_token: int, sampling: SamplingParams,
               num_prompt_tokens: int, deadline_s: float, on_cancel: CancelHook) -> Iterator[DecodeChunk]: ...

    def release(self, decode_worker: str, request_id: str) -> None:
        """Free a reservation (best effort; the worker also expires it). Never raises."""
