"""The live Conductor's ``Dispatcher``: each lifecycle step as a gRPC call to a worker.

Maps gRPC status codes onto ``FailureKind`` in one place (``failure_kind``), converts block
events on the Prefill response to index events, and cancels in-flight calls through the
lifecycle's cancel hooks. A prefill past its attempt's bound (``PrefillCall.timeout_s``)
before the request's deadline is ``STALLED``; so is a decode stream that sends nothing for
``decode_stall_s`` (a hung decode worker: ``StallWatch`` cancels it, and the lifecycle
migrates the request). A plan that pulls a prefix carries the Conductor's grant for it. A worker that stops
heartbeating (dead, or a stopped process) is out of the registry within about a lease, and
``workers_lost`` then gives up every call in flight to it as ``STALLED``, so its requests are
retried or migrated at once rather than after the prefill timeout. The decode reservations it
holds, from a Reserve's answer to the Decode call or Release, are renewed (``ReservationLeases``),
so a decode worker frees them within its TTL of this Conductor's death, and never while it lives.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc

from conductor.cluster import Cluster, Endpoint
from conductor.dispatch import CancelHook, DecodeChunk, DispatchError, FailureKind, PrefillCall, PrefillResult
from engine.sampling_params import SamplingParams
from proto import internal_pb2 as ipb
from proto.convert import prefill_call_to_proto, prefill_result_from_proto, sampling_to_proto
from runtime.auth import grant

log = logging.getLogger(__name__)

_KINDS = {
    grpc.StatusCode.UNAVAILABLE: FailureKind.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: FailureKind.BUSY,
    grpc.StatusCode.DEADLINE_EXCEEDED: FailureKind.DEADLINE,
    grpc.StatusCode.CANCELLED: FailureKind.CANCELLED,
    grpc.StatusCode.INVALID_ARGUMENT: FailureKind.REFUSED,
    grpc.StatusCode.FAILED_PRECONDITION: FailureKind.REFUSED,
    grpc.StatusCode.ALREADY_EXISTS: FailureKind.REFUSED,
}


# What gRPC's core says (with UNKNOWN or INTERNAL) when the worker's connection drops mid-call: the worker
# died or was cut off, which is UNAVAILABLE for retrying, not an error of the worker's own.
_CONNECTION_LOST = ("stream removed", "socket closed", "connection reset")


def failure_kind(code: grpc.StatusCode | None, details: str = "") -> FailureKind:
    """The failure kind of a worker call that ended with ``code``. A transfer failure is
    reported as UNAVAILABLE with a message saying so; a connection lost mid-call counts as
    UNAVAILABLE whatever code gRPC gave it."""
    kind = _KINDS.get(code, FailureKind.INTERNAL) if code is not None else FailureKind.INTERNAL
    lowered = details.lower()
    if kind is FailureKind.UNAVAILABLE and "transfer" in lowered:
        return FailureKind.TRANSFER
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and any(m in lowered for m in _CONNECTION_LOST):
        return FailureKind.UNAVAILABLE
    return kind


def _lost(worker_id: str, what: str) -> DispatchError:
    return DispatchError(FailureKind.STALLED, worker_id, f"{what} given up: the worker stopped heartbeating "
                                                       f"(dead or hung)")


def _error(worker_id: str, e: grpc.RpcError, what: str) -> DispatchError:
    return DispatchError(failure_kind(e.code(), e.details() or ""), worker_id, f"{what} failed: {e.details()}")


class StallWatch:
    """Cancels streams that made no progress for ``limit_s``: one daemon thread checks every
    watched stream a few times per ``limit_s``; ``touch`` is one clock read. Thread-safe."""

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic):
        self.limit_s, self._clock = limit_s, clock
        self._streams: dict[int, list] = {}  # id -> [last progress, cancel, stalled flag]
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, cancel: Callable[[], object]) -> int:
        with self._lock:
            key = next(self._ids)
            self._streams[key] = [self._clock(), cancel, False]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
                self._thread.start()
            return key

    def touch(self, key: int) -> None:
        self._streams[key][0] = self._clock()

    def done(self, key: int) -> bool:
        """Stops watching; True when the stream was cancelled as stalled."""
        with self._lock:
            return self._streams.pop(key)[2]

    def check(self) -> None:
        now = self._clock()
        with self._lock:
            stalled = [s for s in self._streams.values() if not s[2] and now - s[0] > self.limit_s]
            for s in stalled:
                s[2] = True
        for s in stalled:
            s[1]()

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.limit_s / 4))
            self.check()


class ReservationLeases:
    """Keeps the decode reservations this Conductor holds alive: one daemon thread renews each
    worker's held ids in one ``renew(worker, ids)`` call every ``interval_s``, or a third of
    the shortest TTL a worker answered with if that is sooner. A reservation is held from
    ``hold`` until ``drop`` (its Decode call, or Release), until the worker says it holds
    nothing for it, or until ``until_s`` (the request's deadline: a request that never
    dropped it cannot keep it past that). A Conductor that dies renews nothing, so what it
    reserved is freed within one TTL. ``interval_s`` 0: nothing is held or renewed.
    ``background`` False: no thread, the caller renews (``renew_now``). Thread-safe."""

    def __init__(self, renew: Callable[[str, list[str]], list[str]], interval_s: float,
                 clock: Callable[[], float] = time.monotonic, background: bool = True):
        self.interval_s, self._renew, self._clock, self._background = interval_s, renew, clock, background
        self._held: dict[str, dict[str, float]] = {}  # worker -> request id -> held until (monotonic)
        self._ttl_s = math.inf  # the shortest TTL a worker answered with
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failing: set[str] = set()  # workers whose last renewal failed (logged once until it works)

    def hold(self, worker_id: str, request_id: str, ttl_s: float, for_s: float) -> None:
        if self.interval_s <= 0:
            return
        with self._lock:
            self._held.setdefault(worker_id, {})[request_id] = self._clock() + for_s
            if ttl_s > 0:
                self._ttl_s = min(self._ttl_s, ttl_s)
            if self._thread is None and self._background:
                self._thread = threading.Thread(target=self._run, name="reservation-leases", daemon=True)
                self._thread.start()

    def drop(self, worker_id: str, request_id: str) -> None:
        with self._lock:
            held = self._held.get(worker_id)
            if held is not None:
                held.pop(request_id, None)
                if not held:
                    del self._held[worker_id]

    def held(self) -> dict[str, list[str]]:
        """Worker -> the ids held there now."""
        with self._lock:
            return {w: list(ids) for w, ids in self._held.items()}

    def renew_now(self) -> None:
        """One pass: forget what outlived its request, renew the rest, one call per worker."""
        now = self._clock()
        with self._lock:
            for worker_id in list(self._held):
                ids = self._held[worker_id]
                for rid in [rid for rid, until in ids.items() if until <= now]:
                    del ids[rid]
                if not ids:
                    del self._held[worker_id]
            batches = {w: list(ids) for w, ids in self._held.items()}
        for worker_id, ids in batches.items():
            try:
                unknown = self._renew(worker_id, ids)
            except Exception as e:  # a worker down or gone: its reservations expire there anyway
                if worker_id not in self._failing:
                    self._failing.add(worker_id)
                    log.warning("renewing %d reservations on %s failed: %s", len(ids), worker_id, e)
                continue
            self._failing.discard(worker_id)
            for rid in unknown:
                self.drop(worker_id, rid)

    def period_s(self) -> float:
        """Seconds between passes; also each renewal call's bound, so a hung worker delays the
        next worker's renewal by at most one period (two periods apart: under the TTL)."""
        with self._lock:
            return max(0.05, min(self.interval_s, self._ttl_s / 3))

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s())
            self.renew_now()


class InFlight:
    """The calls in flight per worker, so that a lost worker's can be given up at once."""

    def __init__(self) -> None:
        self._calls: dict[str, dict[int, Callable[[], object]]] = {}
        self._lost: set[int] = set()
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def add(self, worker_id: str, cancel: Callable[[], object]) -> int:
        with self._lock:
            key = next(self._ids)
            self._calls.setdefault(worker_id, {})[key] = cancel
            return key

    def done(self, worker_id: str, key: int) -> bool:
        """Stops tracking the call; True when it was given up because its worker was lost."""
        with self._lock:
            self._calls.get(worker_id, {}).pop(key, None)
            if key in self._lost:
                self._lost.discard(key)
                return True
            return False

    def lose(self, worker_ids: Sequence[str]) -> int:
        """Cancels every call in flight to ``worker_ids``; how many."""
        with self._lock:
            calls = [(key, cancel) for w in worker_ids for key, cancel in self._calls.pop(w, {}).items()]
            self._lost.update(key for key, _ in calls)
        for _, cancel in calls:
            cancel()
        return len(calls)


class GrpcDispatcher:
    """``decode_stall_s``: a decode stream silent this long is cancelled as STALLED (inf: never)."""

    def __init__(self, cluster: Cluster, decode_stall_s: float = math.inf, renew_s: float = 0.0):
        """``renew_s``: how often the reservations held are renewed (0: never; ``ReservationLeases``)."""
        self.cluster = cluster
        self._stalls = StallWatch(decode_stall_s) if math.isfinite(decode_stall_s) else None
        self._in_flight = InFlight()
        self.leases = ReservationLeases(self._renew, renew_s)

    def workers_lost(self, worker_ids: Sequence[str]) -> None:
        """The registry dropped ``worker_ids`` (their leases ran out): give up their calls."""
        if worker_ids and (n := self._in_flight.lose(worker_ids)):
            log.warning("gave up %d calls in flight to %s (stopped heartbeating)", n, ", ".join(worker_ids))

    def _endpoint(self, worker_id: str) -> Endpoint:
        try:
            return self.cluster.endpoint(worker_id)
        except KeyError as e:  # it left the registry after the decision
            raise DispatchError(FailureKind.UNAVAILABLE, worker_id, "the worker is not alive any more") from e

    def reserve(self, decode_worker: str, request_id: str, num_prompt_tokens: int, max_tokens: int,
                deadline_s: float) -> str:
        stub = self._endpoint(decode_worker).decode
        try:
            resp = stub.Reserve(ipb.ReserveRequest(request_id=request_id, prompt_tokens=num_prompt_tokens,
                                                   max_tokens=max_tokens, deadline_s=deadline_s),
                                timeout=deadline_s)
        except grpc.RpcError as e:
            raise _error(decode_worker, e, "decode reservation") from e
        self.leases.hold(decode_worker, request_id, resp.ttl_s, deadline_s)
        return resp.transfer_address

    def _renew(self, decode_worker: str, request_ids: list[str]) -> list[str]:
        try:
            stub = self.cluster.endpoint(decode_worker).decode
        except KeyError:  # it left the registry: what it held went with it
            return request_ids
        resp = stub.Renew(ipb.RenewRequest(request_ids=request_ids), timeout=self.leases.period_s())
        return list(resp.unknown_ids)

    def prefill(self, prefill_worker: str, call: PrefillCall, on_cancel: CancelHook) -> PrefillResult:
        request = prefill_call_to_proto(self._with_grant(prefill_worker, call))
        bounded = call.timeout_s < call.deadline_s  # the attempt's own bound ends it before the deadline
        future = self._endpoint(prefill_worker).prefill.Prefill.future(
            request, timeout=min(call.deadline_s, call.timeout_s))
        on_cancel(future.cancel)
        tracked = self._in_flight.add(prefill_worker, future.cancel)
        try:
            resp = future.result()
        except (grpc.RpcError, grpc.FutureCancelledError) as e:
            if self._in_flight.done(prefill_worker, tracked):
                raise _lost(prefill_worker, "prefill") from e
            if isinstance(e, grpc.FutureCancelledError):
                raise DispatchError(FailureKind.CANCELLED, prefill_worker, "prefill cancelled") from e
            if bounded and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DispatchError(FailureKind.STALLED, prefill_worker,
                                    f"prefill unanswered after {call.timeout_s:.1f} s (the worker hangs or is "
                                    f"far slower than predicted); cancelled") from e
            raise _error(prefill_worker, e, "prefill") from e
        self._in_flight.done(prefill_worker, tracked)
        return prefill_result_from_proto(prefill_worker, resp)

    def _with_grant(self, prefill_worker: str, call: PrefillCall) -> PrefillCall:
        """``call`` with the holder's address and the grant that lets ``prefill_worker`` (and
        only it, to its own receiver) have exactly the planned blocks from the holder."""
        if not call.holder_worker:
            return call
        holder = self._endpoint(call.holder_worker)
        puller = self._endpoint(prefill_worker).info
        mac, expiry_ms = grant(holder.session_key, call.placement_id, prefill_worker, puller.transfer_address,
                               call.block_keys[: call.num_reuse_blocks], call.deadline_s)
        return dataclasses.replace(call, holder_rpc_address=holder.info.rpc_address, grant=mac,
                                   grant_expiry_ms=expiry_ms)

    def decode(self, decode_worker: str, request_id: str, first_token: int, sampling: SamplingParams,
               num_prompt_tokens: int, deadline_s: float, on_cancel: CancelHook) -> Iterator[DecodeChunk]:
        self.leases.drop(decode_worker, request_id)  # the worker takes the reservation into its batch
        stub = self._endpoint(decode_worker).decode
        stream = stub.Decode(ipb.DecodeRequest(request_id=request_id, first_token=first_token,
                                               sampling=sampling_to_proto(sampling),
                                               prompt_tokens=num_prompt_tokens), timeout=deadline_s)
        on_cancel(stream.cancel)
        watch = self._stalls.watch(stream.cancel) if self._stalls is not None else None
        tracked: int | None = self._in_flight.add(decode_worker, stream.cancel)
        try:
            for msg in stream:
                if watch is not None:
                    self._stalls.touch(watch)
                yield DecodeChunk(tuple(msg.token_ids), msg.finish_reason)
        except grpc.RpcError as e:
            stalled = watch is not None and self._stalls.done(watch)
            watch = None  # done() stopped watching either way
            lost, tracked = self._in_flight.done(decode_worker, tracked), None
            if lost:
                raise _lost(decode_worker, "decode") from e
            if stalled:
                raise DispatchError(FailureKind.STALLED, decode_worker,
                                    f"decode stream sent nothing for {self._stalls.limit_s:g} s (the worker hangs); "
                                    f"cancelled") from e
            raise _error(decode_worker, e, "decode") from e
        finally:
            if watch is not None:
                self._stalls.done(watch)
            if tracked is not None:
                self._in_flight.done(decode_worker, tracked)

    def release(self, decode_worker: str, request_id: str) -> None:
        self.leases.drop(decode_worker, request_id)
        try:
            self.cluster.endpoint(decode_worker).decode.Release(ipb.ReleaseRequest(request_id=request_id), timeout=5)
        except (grpc.RpcError, KeyError) as e:
            log.info("release of %s on %s failed (the worker expires it): %s", request_id, decode_worker, e)
