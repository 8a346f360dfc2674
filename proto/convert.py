"""Conversions between wire messages and in-process values used on both sides of an RPC.

Each wire value has one in-process twin and one conversion each way, here: sampling
parameters, block events, workers' registrations and loads, the prefill call and its result.
Nothing else converts them.
"""

from __future__ import annotations

from clusterstate.workers import PrefillJobLoad, WorkerInfo, WorkerLoad, WorkerRole
from engine.sampling_params import SamplingParams
from kvstore.blocks import Tier
from kvstore.index import BlockEvent
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb
from runtime.calls import PrefillCall, PrefillResult


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    """Wire sampling params to the engine's; top_p 0 (unset) means 1."""
    return SamplingParams(
        max_new_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
        seed=s.seed, stop_token_ids=tuple(s.stop_token_ids),
    )


def block_event(key: bytes, tier: Tier | None, has_snapshot: bool) -> ipb.BlockEvent:
    """A stored/moved block at ``tier``, or a removed one (``tier`` None)."""
    if tier is None:
        return ipb.BlockEvent(key=key, kind=ipb.BLOCK_EVENT_KIND_REMOVED)
    return ipb.BlockEvent(key=key, tier=int(tier), has_snapshot=has_snapshot, kind=ipb.BLOCK_EVENT_KIND_STORED)


def block_event_from_proto(worker_id: str, e: ipb.BlockEvent) -> BlockEvent:
    """``ValueError`` for an event of unknown kind or tier (a peer's broken contract)."""
    if e.kind == ipb.BLOCK_EVENT_KIND_REMOVED:
        return BlockEvent.removed(worker_id, e.key)
    if e.kind == ipb.BLOCK_EVENT_KIND_STORED:
        return BlockEvent.stored(worker_id, e.key, Tier(e.tier), e.has_snapshot)
    raise ValueError(f"block event from {worker_id}: kind {e.kind} is neither STORED nor REMOVED")


ROLES = {ipb.WORKER_ROLE_PREFILL: WorkerRole.PREFILL, ipb.WORKER_ROLE_DECODE: WorkerRole.DECODE}
ROLE_CODES = {role: code for code, role in ROLES.items()}


def worker_from_proto(info: ipb.WorkerInfo) -> WorkerInfo:
    """``ValueError`` naming the field for a role that is neither prefill nor decode, a bad id
    or a negative size (a peer's broken contract)."""
    if info.role not in ROLES:
        raise ValueError(f"worker {info.worker_id}: role must be prefill or decode, got {info.role}")
    return WorkerInfo(info.worker_id, ROLES[info.role], info.rpc_address, info.num_pages_total,
                      info.dram_capacity_bytes, info.ssd_capacity_bytes, info.transfer_address,
                      info.metrics_address, info.model_fingerprint, info.block_size, info.instance_id,
                      max(1, info.tp_size), max(1, info.ep_size), max(1, info.cpp_stages), info.cpp_chunk_tokens)


def worker_to_proto(info: WorkerInfo) -> ipb.WorkerInfo:
    return ipb.WorkerInfo(worker_id=info.worker_id, role=ROLE_CODES[info.role], rpc_address=info.rpc_address,
                          transfer_address=info.transfer_address, model_fingerprint=info.model_fingerprint,
                          block_size=info.block_size, num_pages_total=info.num_pages_total,
                          dram_capacity_bytes=info.dram_capacity_bytes, ssd_capacity_bytes=info.ssd_capacity_bytes,
                          metrics_address=info.metrics_address, instance_id=info.instance_id,
                          tp_size=info.tp_size, ep_size=info.ep_size, cpp_stages=info.cpp_stages,
                          cpp_chunk_tokens=info.cpp_chunk_tokens)


def load_to_proto(load: WorkerLoad) -> ipb.WorkerLoad:
    return ipb.WorkerLoad(
        num_queued=load.num_queued, num_running=load.num_running, num_free_pages=load.num_free_pages,
        num_context_tokens=load.num_context_tokens, request_ids=list(load.request_ids),
        timestamp_s=load.timestamp_s,
        prefill_jobs=[ipb.PrefillJobLoad(request_id=j.request_id, num_new_tokens=j.num_new_tokens,
                                         num_reused_tokens=j.num_reused_tokens, elapsed_s=j.elapsed_s)
                      for j in load.prefill_jobs],
    )


def load_from_proto(load: ipb.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(
        num_queued=load.num_queued, num_running=load.num_running, num_free_pages=load.num_free_pages,
        num_context_tokens=load.num_context_tokens, request_ids=tuple(load.request_ids),
        timestamp_s=load.timestamp_s,
        prefill_jobs=tuple(PrefillJobLoad(j.request_id, j.num_new_tokens, j.num_reused_tokens, j.elapsed_s)
                           for j in load.prefill_jobs),
    )


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                             seed=p.seed, stop_token_ids=list(p.stop_token_ids))


def prefill_call_to_proto(call: PrefillCall) -> ipb.PrefillRequest:
    reuse = ipb.ReusePlan(num_blocks=call.num_reuse_blocks, holder_worker_id=call.holder_worker,
                          holder_rpc_address=call.holder_rpc_address, keep=True, grant=call.grant,
                          grant_expiry_ms=call.grant_expiry_ms)
    return ipb.PrefillRequest(request_id=call.placement_id, token_ids=call.token_ids,
                              sampling=sampling_to_proto(call.sampling), block_keys=call.block_keys, reuse=reuse,
                              decode_transfer_address=call.decode_transfer_address, deadline_s=call.deadline_s,
                              cpp_chunk_tokens=call.cpp_chunk_tokens)


def prefill_call_from_proto(req: ipb.PrefillRequest, default_deadline_s: float) -> PrefillCall:
    return PrefillCall(req.request_id, tuple(req.token_ids), sampling_from_proto(req.sampling), tuple(req.block_keys),
                       req.reuse.num_blocks, req.decode_transfer_address, req.deadline_s or default_deadline_s,
                       req.reuse.holder_worker_id, req.reuse.holder_rpc_address, req.reuse.grant,
                       req.reuse.grant_expiry_ms, cpp_chunk_tokens=req.cpp_chunk_tokens)


def prefill_result_to_proto(result: PrefillResult, events: list[ipb.BlockEvent]) -> ipb.PrefillResponse:
    return ipb.PrefillResponse(first_token=result.first_token, cached_tokens=result.cached_tokens,
                               prefill_s=result.prefill_s, events=events, loaded_tokens=result.loaded_tokens,
                               queue_s=result.queue_s, handoff_s=result.handoff_s)


def prefill_result_from_proto(worker_id: str, resp: ipb.PrefillResponse) -> PrefillResult:
    """``ValueError`` for a malformed block event (a peer's broken contract)."""
    return PrefillResult(resp.first_token, resp.cached_tokens, resp.prefill_s, resp.loaded_tokens,
                         tuple(block_event_from_proto(worker_id, e) for e in resp.events), resp.queue_s, resp.handoff_s)
