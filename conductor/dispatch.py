"""The ``Dispatcher`` protocol: how the request lifecycle applies a routing decision.

The lifecycle decides (``conductor.core``), then hands each step to a dispatcher: reserve on
the decode worker, prefill (which pulls the planned prefix from its holder when the plan
names one, and streams KV to the decode worker), decode, release. The live Conductor's
dispatcher speaks gRPC (``conductor.grpc_dispatch``); the simulator's runs in-process. A
step that fails raises ``DispatchError`` with a typed ``FailureKind``; whether to try again
elsewhere is the pure ``should_retry``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from engine.sampler import SamplingParams
from kvstore.index import BlockEvent


class FailureKind(enum.StrEnum):
    UNAVAILABLE = "unavailable"  # the worker died, is unreachable or is draining
    BUSY = "busy"  # the worker had no room for the request
    TRANSFER = "transfer"  # the KV transfer failed (checksum, truncation, dead peer)
    DEADLINE = "deadline"  # the request's deadline passed
    CANCELLED = "cancelled"  # the client went away
    REFUSED = "refused"  # the worker refused the call as malformed or out of order
    INTERNAL = "internal"  # anything else


RETRYABLE = frozenset({FailureKind.UNAVAILABLE, FailureKind.BUSY, FailureKind.TRANSFER})


class DispatchError(Exception):
    def __init__(self, kind: FailureKind, worker_id: str, message: str):
        super().__init__(f"{worker_id}: {message}")
        self.kind, self.worker_id, self.message = kind, worker_id, message


def should_retry(kind: FailureKind, attempt: int, max_attempts: int, cancelled: bool) -> bool:
    """Route a failed prefill again, away from the workers involved? Only while nothing has
    reached the client (the caller's contract), the client is still there, attempts remain,
    and the failure is one that another worker may not have."""
    return not cancelled and attempt < max_attempts and kind in RETRYABLE


@dataclass(frozen=True)
class PrefillCall:
    request_id: str
    token_ids: tuple[int, ...]
    block_keys: tuple[bytes, ...]
    num_reuse_blocks: int
    holder_worker: str | None  # pull the reused prefix from this worker (it is kept: a replica)
    decode_transfer_address: str
    deadline_s: float


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    cached_tokens: int
    prefill_s: float
    events: tuple[BlockEvent, ...]  # blocks the prefill stored, for the index


@dataclass(frozen=True)
class DecodeChunk:
    token_ids: tuple[int, ...]
    finish_reason: str = ""  # "", "stop", "length", "cancelled" or "failed"


CancelHook = Callable[[Callable[[], None]], None]


class Dispatcher(Protocol):
    """Each method may raise ``DispatchError``; ``on_cancel(hook)`` registers a hook that
    aborts the step when the client goes away."""

    def reserve(self, decode_worker: str, request_id: str, num_prompt_tokens: int, max_tokens: int,
                deadline_s: float) -> str:
        """Reserve pages for prompt + max tokens; returns the decode worker's transfer address."""

    def prefill(self, prefill_worker: str, call: PrefillCall, sampling: SamplingParams,
                on_cancel: CancelHook) -> PrefillResult: ...

    def decode(self, decode_worker: str, request_id: str, first_token: int, sampling: SamplingParams,
               num_prompt_tokens: int, deadline_s: float, on_cancel: CancelHook) -> Iterator[DecodeChunk]: ...

    def release(self, decode_worker: str, request_id: str) -> None:
        """Free a reservation (best effort; the worker also expires it). Never raises."""
