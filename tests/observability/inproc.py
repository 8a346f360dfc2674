"""An instrumented cluster in the test process: the real Conductor lifecycle and core (with a
real ``Cluster`` over its in-memory state), a real ``PrefillRunner`` over a real ``TieredStore``
(DRAM + SSD), a real ``DecodeScheduler``, and the real transfer engine between them (tcp on
127.0.0.1). Only the gRPC hops are replaced by ``InProcDispatcher``, which calls the worker
objects directly, and ``serve`` mirrors ``InferenceService.Generate`` (admission, outcome
counts). Every component reports to one ``CollectorRegistry`` with its own identity.
"""

from __future__ import annotations

import dataclasses
import queue
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import engine
from conductor.admission import Admission
from conductor.clock import SystemClock
from conductor.cluster import Cluster
from conductor.config import ConductorConfig
from conductor.core import ConductorCore
from conductor.dispatch import DecodeChunk, DispatchError, FailureKind, PrefillCall, PrefillResult
from conductor.lifecycle import Refused, RequestLife
from conductor.metrics import ConductorMetrics
from conductor.routing import PolicyContext, make_policy
from conductor.validation import ValidRequest
from costmodel.builtin import tiny_cpu_estimate
from decode_worker.metrics import DecodeMetrics
from decode_worker.scheduler import DecodeScheduler, Finished
from decode_worker.server import FINISH
from decode_worker.sink import expected_for, sink_for
from engine.sampler import SamplingParams
from kvstore.index import BlockEvent
from kvstore.metrics import StoreMetrics
from kvstore.store import StoreConfig, StoreEvent, TieredStore
from kvstore.transfer.base import TransferConfig
from kvstore.transfer.receiver import Receiver
from prefill_worker.metrics import PrefillMetrics
from prefill_worker.runner import Busy, PrefillRunner
from prefill_worker.transfers import TransferHub
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb
from proto.convert import load_to_proto
from runtime.auth import CONDUCTOR, Member, worker_principal
from runtime.metrics import Identity

BS = 16
PREFILL, DECODE = "prefill-0", "decode-0"


@dataclass
class Seen:
    """What the client side saw of one request."""

    tenant: str
    outcome: str = ""  # stop, length, cancelled, failed, rejected
    reason: str = ""
    num_tokens: int = 0
    cached_tokens: int = 0
    first_token: bool = False
    terminals: list[str] = field(default_factory=list)


class InProcDispatcher:
    """The Dispatcher protocol over the worker objects; ``fail_next`` makes the next prefill
    fail with an unretryable INTERNAL error."""

    def __init__(self, cluster: InProcCluster):
        self.c = cluster
        self.fail_next = False
        self._params: dict[str, int] = {}

    def reserve(self, decode_worker: str, request_id: str, num_prompt_tokens: int, max_tokens: int,
                deadline_s: float) -> str:
        seq = self.c.scheduler.try_reserve(request_id, num_prompt_tokens + max_tokens)
        if seq is None:
            raise DispatchError(FailureKind.BUSY, decode_worker, "decode cache full")
        cache = self.c.scheduler.cache
        self.c.receiver.expect(request_id, sink_for(cache, seq), expected_for(cache, num_prompt_tokens), deadline_s)
        return self.c.receiver.address

    def prefill(self, prefill_worker: str, call: PrefillCall, on_cancel) -> PrefillResult:
        if self.fail_next:
            self.fail_next = False
            raise DispatchError(FailureKind.INTERNAL, prefill_worker, "injected failure")
        try:
            out = self.c.runner.run(dataclasses.replace(call, holder_worker=""), lambda: False)
        except Busy as e:
            raise DispatchError(FailureKind.BUSY, prefill_worker, str(e)) from e
        self.c.heartbeat()
        return dataclasses.replace(out, events=tuple(self.c.drain_events()))

    def decode(self, decode_worker: str, request_id: str, first_token: int, sampling: SamplingParams,
               num_prompt_tokens: int, deadline_s: float, on_cancel) -> Iterator[DecodeChunk]:
        self.c.receiver.wait_complete(request_id, deadline_s)
        out = self.c.scheduler.start_decoding(request_id, num_prompt_tokens, first_token, sampling)
        on_cancel(lambda: self.c.scheduler.release(request_id))
        while True:
            try:
                item = out.get(timeout=30)
            except queue.Empty as e:
                raise DispatchError(FailureKind.DEADLINE, decode_worker, "no token within 30 s") from e
            if isinstance(item, Finished):
                yield DecodeChunk((), FINISH[item.reason])  # as the decode worker's server sends it
                return
            yield DecodeChunk(tuple(item))

    def release(self, decode_worker: str, request_id: str) -> None:
        self.c.receiver.cancel(request_id)
        self.c.scheduler.release(request_id)


class InProcCluster:
    def __init__(self, registry, config: ConductorConfig, dram_blocks: int = 6):
        self.registry, self.config = registry, config
        self.model = engine.load_model("tiny")
        self.tmp = tempfile.TemporaryDirectory(prefix="tidekv-obs-")
        self._events: list[StoreEvent] = []
        self._events_lock = threading.Lock()
        block_bytes = self._block_bytes()
        self.store = TieredStore(
            StoreConfig(self.model.fingerprint, dram_capacity_bytes=dram_blocks * block_bytes,
                        ssd_capacity_bytes=400 * block_bytes, ssd_dir=f"{self.tmp.name}/ssd", ssd_fsync=False),
            on_event=self._on_event, metrics=StoreMetrics(Identity(PREFILL, "prefill", "tiny"), registry))
        self.hub = TransferHub(TransferConfig())
        self.runner = PrefillRunner(self.model, self.store, self.hub, self.model.new_cache(512, 2, BS), 2,
                                    metrics=PrefillMetrics(Identity(PREFILL, "prefill", "tiny"), registry))
        self.scheduler = DecodeScheduler(self.model, 1024, 16, BS,
                                         metrics=DecodeMetrics(Identity(DECODE, "decode", "tiny"), registry))
        self.scheduler.start()
        self.receiver = Receiver(TransferConfig())
        self.cluster = Cluster.in_memory(Member(b"in-process" * 8, CONDUCTOR), ttl_s=3600)
        for worker_id, role, pages in ((PREFILL, ipb.WORKER_ROLE_PREFILL, 512), (DECODE, ipb.WORKER_ROLE_DECODE, 1024)):
            reason = self.cluster.register(ipb.WorkerInfo(
                worker_id=worker_id, role=role, rpc_address="127.0.0.1:1", transfer_address=self.receiver.address,
                model_fingerprint=self.model.fingerprint, block_size=BS, num_pages_total=pages,
                instance_id="i" * 32), worker_principal(worker_id))
            assert reason is None, reason
        self.heartbeat()
        policy = make_policy(config.policy, PolicyContext(config.routing, tiny_cpu_estimate()))
        self.core = ConductorCore(self.cluster, policy, config.slos, SystemClock())
        self.metrics = ConductorMetrics.for_config(config, registry)
        self.admission = Admission(config.admission)
        self.metrics.watch(self.cluster, self.admission)
        self.dispatcher = InProcDispatcher(self)
        self.tokenizer = engine.load_tokenizer("tiny")
        self._seq = 0

    def _block_bytes(self) -> int:
        from kvstore.payload_format import encode
        from prefill_worker.blocks import payload_of_block

        cache = self.model.new_cache(4, 1, BS)
        seq = cache.try_reserve("probe", BS)
        self.model.prefill(cache, seq, list(range(1, BS + 1)), snapshot_at=[BS])
        size = len(encode(payload_of_block(self.model, cache, seq, 0)))
        cache.release(seq)
        return size

    def _on_event(self, e: StoreEvent) -> None:
        with self._events_lock:
            self._events.append(e)

    def drain_events(self) -> list[BlockEvent]:
        with self._events_lock:
            events, self._events = self._events, []
        return [BlockEvent.removed(PREFILL, e.key) if e.kind == "removed"
                else BlockEvent.stored(PREFILL, e.key, e.tier, e.has_snapshot) for e in events]

    def heartbeat(self) -> None:
        self.cluster.heartbeat(PREFILL, load_to_proto(self.runner.load()), [])
        self.cluster.heartbeat(DECODE, load_to_proto(self.scheduler.load()), [])

    def request(self, prompt: list[int], max_tokens: int, tenant: str = "", ttft_slo_s: float = 0.0) -> ValidRequest:
        return ValidRequest(tuple(prompt), SamplingParams(max_new_tokens=max_tokens), 60.0, tenant, ttft_slo_s)

    def serve(self, req: ValidRequest, cancel_after_tokens: int = 0) -> Seen:
        """``InferenceService.Generate`` without gRPC: admission, the lifecycle, outcome counts
        (as the wired server reports them); ``cancel_after_tokens`` closes the stream early, as
        a client that goes away does."""
        seen = Seen(req.tenant)
        if self.admission.try_enter(timeout_s=5.0) is not None:
            self.metrics.refused(req.tenant, "rejected", "queue_full")
            seen.outcome, seen.reason = "rejected", "queue_full"
            return seen
        self._seq += 1
        life = RequestLife(self.core, self.dispatcher, self.tokenizer, req, uuid.uuid4().hex, self._seq,
                           self.config.max_prefill_attempts, self.metrics)
        stream = life.run()
        try:
            for msg in stream:
                self._observe(seen, msg)
                if cancel_after_tokens and seen.num_tokens >= cancel_after_tokens and not msg.finish_reason:
                    life.cancel()
                    stream.close()  # what gRPC does to the generator of a cancelled call
                    seen.outcome = "cancelled"
                    break
        except Refused as e:
            self.metrics.refused(req.tenant, "rejected", e.reason)
            seen.outcome, seen.reason = "rejected", e.reason
        finally:
            self.admission.leave()
        self.heartbeat()
        return seen

    @staticmethod
    def _observe(seen: Seen, msg: pb.GenerateResponse) -> None:
        if msg.token_ids and not seen.first_token:
            seen.first_token = True
            seen.cached_tokens = msg.usage.cached_tokens
        seen.num_tokens += len(msg.token_ids)
        if msg.finish_reason:
            seen.outcome = pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
            seen.terminals.append(seen.outcome)

    def refuse_at_admission(self, tenant: str) -> Seen:
        """A request refused because admission is full (as the server counts it)."""
        self.metrics.refused(tenant, "rejected", "queue_full")
        return Seen(tenant, "rejected", "queue_full")

    def invalid(self) -> Seen:
        self.metrics.refused("", "invalid", "invalid_argument")
        return Seen("", "invalid", "invalid_argument")

    def close(self) -> None:
        self.scheduler.stop()
        self.receiver.close()
        self.hub.close()
        self.store.close()
        self.tmp.cleanup()
