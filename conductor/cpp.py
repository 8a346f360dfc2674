"""A chunked-pipeline (CPP) prefill group as one schedulable unit: its predicted prefill time
and the per-request choice to pipeline a prompt through its stages.

A CPP group (Mooncake FAST'25 §5.1) is one registered prefill worker whose ranks each compute
a range of layers (``WorkerView.cpp_stages``, ``cpp_chunk_tokens``; ``engine.parallel.pipeline``).
For a prompt of ``new`` tokens cut into ``C`` chunks over ``S`` stages, stage s works on chunk
k while stage s-1 works on chunk k+1::

    pipelined_s   = fixed + (single_s - fixed) * (C + S - 1) / (C * S) + C * S * HOP_S
    one chunk     = single_s + S * HOP_S                  (the stages in turn, no overlap)

``single_s`` is the calibrated single-instance time ``prefill_s(new, reused)`` (the same
formula the simulator's modelled workers use), ``fixed`` its constant term, ``HOP_S`` a chunk's
hand-over between two stages. The rule, computed here only and called by every policy (through
``with_pipeline``, which ``conductor.routing.make_policy`` wraps around each) and by the
simulator: pipeline the request when the pipelined prediction beats one chunk by at least
``MIN_GAIN``. Since the gain grows with the prompt, that is a threshold on its length
(``threshold_tokens``). Pure.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conductor.routing import ClusterSnapshot, Policy, RouteRequest, WorkerView
    from costmodel import CostModels

HOP_S = 0.002  # one chunk's hidden states from a stage to the next, and its rows back: loopback, ~1 MB
MIN_GAIN = 0.05  # pipeline only when it predicts at least 5% less time than one chunk
NO_COSTS_MIN_CHUNKS = 2  # without cost models: pipeline prompts of at least two chunks
MAX_THRESHOLD_TOKENS = 1 << 22


def pipelined_from(single_s: float, fixed_s: float, new_tokens: int, stages: int, chunk_tokens: int) -> float:
    """The pipelined time of a prefill whose single-instance time is ``single_s``."""
    chunks = max(1, math.ceil(new_tokens / chunk_tokens))
    return fixed_s + max(0.0, single_s - fixed_s) * (chunks + stages - 1) / (chunks * stages) + chunks * stages * HOP_S


def one_chunk_from(single_s: float, stages: int) -> float:
    """The time of a prefill that passes the stages in turn (not pipelined)."""
    return single_s + stages * HOP_S


def pipeline_chunk_tokens(costs: CostModels | None, stages: int, chunk_tokens: int, new_tokens: int,
                          reused_tokens: int = 0) -> int:
    """The chunk to pipeline a prefill of ``new_tokens`` over ``stages`` in, or 0 not to."""
    if stages <= 1 or chunk_tokens <= 0 or new_tokens <= chunk_tokens:
        return 0
    if costs is None:
        return chunk_tokens if new_tokens >= NO_COSTS_MIN_CHUNKS * chunk_tokens else 0
    single = costs.prefill_s(new_tokens, reused_tokens)
    pipelined = pipelined_from(single, costs.prefill_const_s, new_tokens, stages, chunk_tokens)
    return chunk_tokens if pipelined <= (1 - MIN_GAIN) * one_chunk_from(single, stages) else 0


def threshold_tokens(costs: CostModels | None, stages: int, chunk_tokens: int) -> int:
    """The shortest prompt (no reuse) the rule pipelines: the cost-model threshold on prompt
    length (``MAX_THRESHOLD_TOKENS`` when none is)."""
    lo, hi = 1, MAX_THRESHOLD_TOKENS
    if not pipeline_chunk_tokens(costs, stages, chunk_tokens, hi):
        return MAX_THRESHOLD_TOKENS
    while lo < hi:
        mid = (lo + hi) // 2
        if pipeline_chunk_tokens(costs, stages, chunk_tokens, mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def unit_prefill_s(costs: CostModels, worker: WorkerView, new_tokens: int, reused_tokens: int) -> float:
    """The predicted prefill time on ``worker`` (before its speed factor): a CPP group's
    pipelined or one-chunk time by the rule, any other worker's calibrated time."""
    single = costs.prefill_s(new_tokens, reused_tokens)
    if worker.cpp_stages <= 1:
        return single
    chunk = pipeline_chunk_tokens(costs, worker.cpp_stages, worker.cpp_chunk_tokens, new_tokens, reused_tokens)
    if chunk:
        return pipelined_from(single, costs.prefill_const_s, new_tokens, worker.cpp_stages, chunk)
    return one_chunk_from(single, worker.cpp_stages)


def with_pipeline(policy: Policy, costs: CostModels | None) -> Policy:
    """``policy`` whose decisions carry the pipeline choice for their prefill worker (0 for a
    worker that is no CPP group)."""
    from conductor.routing import RouteDecision

    def pipelined(snapshot: ClusterSnapshot, request: RouteRequest):
        decision = policy(snapshot, request)
        if not isinstance(decision, RouteDecision):
            return decision
        chosen = decision.prefill_worker
        worker = next((w for w in snapshot.prefill if w.worker_id == chosen), None)
        if worker is None or worker.cpp_stages <= 1:
            return decision
        reused = min(decision.reuse.num_blocks * request.block_size, request.num_prompt_tokens - 1)
        chunk = pipeline_chunk_tokens(costs, worker.cpp_stages, worker.cpp_chunk_tokens,
                                      request.num_prompt_tokens - reused, reused)
        return dataclasses.replace(decision, cpp_chunk_tokens=chunk) if chunk else decision

    return pipelined
