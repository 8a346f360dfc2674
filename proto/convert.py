"""Conversions between wire messages and in-process values used on both sides of an RPC.

Each wire value has one in-process twin and one conversion each way, here: sampling
parameters, block events, workers' registrations and loads. Nothing else converts them.
"""

from __future__ import annotations

from clusterstate.workers import PrefillJobLoad, WorkerInfo, WorkerLoad, WorkerRole
from engine.sampler import SamplingParams
from kvstore.blocks import Tier
from kvstore.index import BlockEvent
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb


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


FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_CANCELLED: "cancelled", pb.FINISH_REASON_FAILED: "failed",
                pb.FINISH_REASON_REJECTED: "rejected"}
FINISH_CODES = {name: code for code, name in FINISH_NAMES.items()}
