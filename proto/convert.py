"""Conversions between wire messages and in-process values used on both sides of an RPC."""

from __future__ import annotations

from engine.sampler import SamplingParams
from kvstore.blocks import Tier
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    """Wire sampling params to the engine's; top_p 0 (unset) means 1."""
    return SamplingParams(
        max_new_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
        seed=s.seed, stop_token_ids=tuple(s.stop_token_ids),
    )


def block_event(key: bytes, tier: Tier | None, has_snapshot: bool) -> ipb.BlockEvent:
    """A stored/moved block at ``tier``, or a removed one (tier None -> -1 on the wire)."""
    return ipb.BlockEvent(key=key, tier=-1 if tier is None else int(tier), has_snapshot=has_snapshot)
