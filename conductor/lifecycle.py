"""One request's life in the Conductor (docs/architecture.md, steps 2-9).

``RequestLife.run`` is a generator of ``GenerateResponse`` messages: route, reserve on the
decode worker, prefill (which streams KV to the decode worker and returns the first token),
then forward the decode worker's tokens. A prefill that fails before anything reached the
client (a worker died, a transfer failed, a worker was full) is routed again once, away from
the workers involved, and recomputed. It yields exactly one terminal message (finish
reason set) unless the request is refused before any work (the caller aborts with a status).
Cancellation (client gone) cancels the in-flight worker RPCs and releases the reservation.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from conductor.cluster import Cluster
from conductor.routing import ClusterSnapshot, Policy, Rejection, RouteDecision, RouteRequest
from conductor.validation import ValidRequest
from engine.tokenizer import Tokenizer
from kvstore.blocks import chain_keys
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 2
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class Refused(Exception):
    """Ends a request before any work with a gRPC status (RESOURCE_EXHAUSTED, UNAVAILABLE)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.code, self.retry_after_s = code, retry_after_s


@dataclass
class _Timeline:
    arrival: float
    prefill_start: float = 0.0
    first_token: float = 0.0


class RequestLife:
    def __init__(self, cluster: Cluster, policy: Policy, tokenizer: Tokenizer, req: ValidRequest,
                 request_id: str, seq: int, raw_sampling: pb.SamplingParams):
        self.cluster, self.policy, self.tokenizer, self.req = cluster, policy, tokenizer, req
        self.request_id = request_id or uuid.uuid4().hex
        self.seq = seq
        self.sampling = raw_sampling
        self.t = _Timeline(time.monotonic())
        self._cancel_hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.cancelled = False

    def cancel(self) -> None:
        """Client went away: stop worker RPCs and free the decode reservation. Idempotent."""
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
        return max(0.1, self.req.deadline_s - (time.monotonic() - self.t.arrival))

    # ---- the lifecycle ----------------------------------------------------------------------
    def run(self) -> Iterator[pb.GenerateResponse]:
        avoid: set[str] = set()
        for attempt in range(1, MAX_ATTEMPTS + 1):
            decision, keys = self._route(avoid)
            decode_ep = self.cluster.endpoint(decision.decode_worker)
            reserve = self._reserve(decode_ep.decode)
            release = _releaser(decode_ep.decode, self.request_id)
            self._on_cancel(release)
            try:
                prefill = self._prefill(decision, keys, reserve.transfer_address)
                break
            except grpc.RpcError as e:
                release()
                error = f"prefill on {decision.prefill_worker} failed: {e.details()}"
                if attempt < MAX_ATTEMPTS and not self.cancelled and e.code() in RETRYABLE:
                    # Nothing reached the client yet and no partial cache is kept: route again,
                    # away from the workers that failed, and recompute.
                    log.warning("request %s: %s; retrying elsewhere", self.request_id, error)
                    avoid.update((decision.prefill_worker, decision.decode_worker))
                    continue
                reason = pb.FINISH_REASON_CANCELLED if self.cancelled else pb.FINISH_REASON_FAILED
                yield self._terminal(reason, [], 0, error=error)
                return
        self.t.first_token = time.monotonic()
        tokens = [prefill.first_token]
        usage = pb.Usage(prompt_tokens=len(self.req.prompt_ids), cached_tokens=prefill.cached_tokens,
                         completion_tokens=1)
        yield pb.GenerateResponse(request_id=self.request_id, token_ids=tokens,
                                  text=self.tokenizer.decode(tokens), usage=usage,
                                  prefill_worker=decision.prefill_worker, decode_worker=decision.decode_worker)
        params = self.req.params
        if prefill.first_token in params.stop_token_ids or params.max_new_tokens == 1:
            release()
            reason = pb.FINISH_REASON_STOP if prefill.first_token in params.stop_token_ids else pb.FINISH_REASON_LENGTH
            yield self._terminal(reason, tokens, prefill.cached_tokens)
            return
        yield from self._decode(decode_ep.decode, prefill.first_token, tokens, prefill.cached_tokens)

    def _route(self, avoid: set[str]) -> tuple[RouteDecision, list[bytes]]:
        """A decision over the live cluster; workers in ``avoid`` are left out while others of
        their role remain."""
        fp, bs = self.cluster.model_fingerprint, self.cluster.block_size
        if fp is None or bs is None:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "no workers registered yet", 5.0)
        ids = self.req.prompt_ids
        keys = chain_keys(ids, bs, fp, self.req.tenant)
        snapshot = self.cluster.snapshot(keys, time.monotonic())
        if avoid:
            snapshot = ClusterSnapshot(
                tuple(w for w in snapshot.prefill if w.worker_id not in avoid) or snapshot.prefill,
                tuple(w for w in snapshot.decode if w.worker_id not in avoid) or snapshot.decode,
                snapshot.time_s,
            )
        route_req = RouteRequest(self.request_id, self.seq, len(ids), len(keys), self.req.params.max_new_tokens, bs)
        decision = self.policy(snapshot, route_req)
        if isinstance(decision, Rejection):
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, decision.reason, decision.retry_after_s)
        return decision, keys

    def _reserve(self, stub) -> ipb.ReserveResponse:
        try:
            return stub.Reserve(ipb.ReserveRequest(
                request_id=self.request_id, prompt_tokens=len(self.req.prompt_ids),
                max_tokens=self.req.params.max_new_tokens, deadline_s=self._left_s()), timeout=self._left_s())
        except grpc.RpcError as e:
            code = e.code() if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else grpc.StatusCode.UNAVAILABLE
            raise Refused(code, f"decode reservation failed: {e.details()}") from e

    def _prefill(self, decision: RouteDecision, keys: list[bytes], transfer_address: str) -> ipb.PrefillResponse:
        holder = decision.reuse.holder
        holder_addr = ""
        if holder and holder != decision.prefill_worker:
            holder_addr = self.cluster.endpoint(holder).info.rpc_address
        ep = self.cluster.endpoint(decision.prefill_worker)
        self.t.prefill_start = time.monotonic()
        future = ep.prefill.Prefill.future(ipb.PrefillRequest(
            request_id=self.request_id, token_ids=self.req.prompt_ids, sampling=self.sampling, block_keys=keys,
            reuse=ipb.ReusePlan(num_blocks=decision.reuse.num_blocks, holder_worker_id=holder or "",
                                holder_rpc_address=holder_addr),
            decode_transfer_address=transfer_address, deadline_s=self._left_s()), timeout=self._left_s())
        self._on_cancel(future.cancel)
        resp = future.result()
        self.cluster.apply_events(decision.prefill_worker, list(resp.events))
        return resp

    def _decode(self, stub, first: int, tokens: list[int], cached: int) -> Iterator[pb.GenerateResponse]:
        stream = stub.Decode(ipb.DecodeRequest(request_id=self.request_id, first_token=first,
                                               sampling=self.sampling, prompt_tokens=len(self.req.prompt_ids)),
                             timeout=self._left_s())
        self._on_cancel(stream.cancel)
        sent_text = self.tokenizer.decode(tokens)
        try:
            for msg in stream:
                if msg.token_ids:
                    tokens.extend(msg.token_ids)
                    text = self.tokenizer.decode(tokens)
                    yield pb.GenerateResponse(request_id=self.request_id, token_ids=msg.token_ids,
                                              text=text[len(sent_text):])
                    sent_text = text
                if msg.finish_reason:
                    yield self._terminal(msg.finish_reason, tokens, cached)
                    return
            yield self._terminal(pb.FINISH_REASON_FAILED, tokens, cached, error="decode stream ended early")
        except grpc.RpcError as e:
            reason = pb.FINISH_REASON_CANCELLED if self.cancelled else pb.FINISH_REASON_FAILED
            yield self._terminal(reason, tokens, cached, error=f"decode failed: {e.details()}")

    def _terminal(self, reason: int, tokens: list[int], cached: int, error: str = "") -> pb.GenerateResponse:
        now = time.monotonic()
        decode_s = now - self.t.first_token if self.t.first_token else 0.0
        timing = pb.Timing(
            queue_s=(self.t.prefill_start or now) - self.t.arrival,
            ttft_s=(self.t.first_token - self.t.arrival) if self.t.first_token else 0.0,
            total_s=now - self.t.arrival,
            decode_tokens_per_s=(len(tokens) - 1) / decode_s if decode_s > 0 and len(tokens) > 1 else 0.0,
        )
        usage = pb.Usage(prompt_tokens=len(self.req.prompt_ids), cached_tokens=cached, completion_tokens=len(tokens))
        if error:
            log.warning("request %s: %s", self.request_id, error)
        return pb.GenerateResponse(request_id=self.request_id, finish_reason=reason, usage=usage, timing=timing,
                                   error=error)


def _releaser(stub, request_id: str) -> Callable[[], None]:
    """Frees a decode reservation (best effort; the worker also expires it)."""
    return lambda: _quiet(stub.Release, ipb.ReleaseRequest(request_id=request_id))


def _quiet(call, request) -> None:
    """A best-effort cleanup RPC: failures are logged, not raised (the worker also expires it)."""
    try:
        call(request, timeout=5)
    except grpc.RpcError as e:
        log.info("cleanup call failed: %s", e.details())
