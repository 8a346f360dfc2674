"""The prefill call and its result: one value each, the same on both sides of
``Prefill/Prefill`` (the Conductor makes a ``PrefillCall``, the prefill worker runs it and
answers a ``PrefillResult``), converted to and from the wire once, in ``proto/convert.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from kvstore.index import BlockEvent


@dataclass(frozen=True)
class PrefillCall:
    """One placement's prefill. ``placement_id``: the id the workers know this attempt by
    (``conductor.dispatch.placement_id``); ``num_reuse_blocks``: leading blocks of
    ``block_keys`` to reuse, from the worker's own tiers or, with ``holder_worker``, pulled
    from that worker under the Conductor's ``grant``."""

    placement_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    block_keys: tuple[bytes, ...]
    num_reuse_blocks: int
    decode_transfer_address: str
    deadline_s: float  # seconds left of the request's deadline (the worker's bound too)
    holder_worker: str = ""  # "": reuse from the own tiers
    holder_rpc_address: str = ""
    grant: bytes = b""  # the Conductor's grant for the pull (runtime.auth.grant)
    grant_expiry_ms: int = 0
    timeout_s: float = math.inf  # the Conductor's bound on this attempt (not sent: STALLED past it)
    cpp_chunk_tokens: int = 0  # a CPP group pipelines the prompt in chunks of this (0: not; conductor.cpp)


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    cached_tokens: int
    prefill_s: float  # the worker's own time for it (engine taken to the decode worker's verdict)
    loaded_tokens: int = 0  # of cached_tokens, those copied into pages (the rest reused in place)
    events: tuple[BlockEvent, ...] = ()  # blocks the prefill stored, for the index (the Conductor's side)
    queue_s: float = 0.0  # the worker's wait for its engine before prefill_s began (other prefills)
    handoff_s: float = 0.0  # of prefill_s, handing the KV to the decode worker: the push and the verdict
