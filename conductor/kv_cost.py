"""``kv_cost``: NVIDIA Dynamo's KV router cost, for comparison with ``mooncake``.

Dynamo scores every worker by ``overlap_score_weight * prefill_blocks + decode_blocks`` and
takes the minimum (temperature 0) or samples from a softmax over the normalised negated
costs (temperature > 0). Mapped onto a prefill pool:

- ``prefill_blocks(w)``: the request's blocks that ``w`` would have to compute (its blocks
  minus the prefix ``w`` holds for it);
- ``decode_blocks(w)``: the blocks ``w`` is already busy with (its queued and running
  prefills, in blocks).

The decode worker is the least loaded one with room; the reuse plan is the shared one. The
sampling is seeded by ``routing.seed`` and the request, so the policy stays pure.
"""

from __future__ import annotations

import hashlib
import math

from conductor.policies import least_loaded_decode
from conductor.routing import (
    ClusterSnapshot,
    Policy,
    PolicyContext,
    Rejection,
    RouteDecision,
    RouteRequest,
    WorkerView,
    admission_rejection,
    capped_usable,
    decide,
    fitting_decode,
    register_policy,
)


def kv_cost(worker: WorkerView, request: RouteRequest, overlap_weight: float) -> float:
    """Dynamo's cost of sending ``request`` to prefill worker ``worker`` (in blocks)."""
    request_blocks = math.ceil(request.num_prompt_tokens / request.block_size)
    prefill_blocks = request_blocks - capped_usable(worker, request)
    busy_blocks = math.ceil(worker.num_queued_tokens / request.block_size)
    return overlap_weight * prefill_blocks + busy_blocks


def _softmax_pick(costs: list[float], temperature: float, seed: int, request: RouteRequest) -> int:
    """Index drawn from softmax(-normalised cost / temperature) with a request-seeded uniform."""
    top = max(costs) or 1.0
    logits = [-(c / top) / temperature for c in costs]
    peak = max(logits)
    weights = [math.exp(v - peak) for v in logits]
    digest = hashlib.blake2b(f"{seed}/{request.seq}/{request.request_id}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "little") / 2**64 * sum(weights)
    for i, w in enumerate(weights):
        u -= w
        if u < 0:
            return i
    return len(weights) - 1


@register_policy("kv_cost")
def make_kv_cost(context: PolicyContext) -> Policy:
    weight, temperature, seed = (context.routing.kv_cost_overlap_weight, context.routing.kv_cost_temperature,
                                 context.routing.seed)

    def kv_cost_policy(snapshot: ClusterSnapshot, request: RouteRequest) -> RouteDecision | Rejection:
        rejection = admission_rejection(snapshot, request)
        if rejection is not None:
            return rejection
        workers = sorted(snapshot.prefill, key=lambda w: w.worker_id)
        costs = [kv_cost(w, request, weight) for w in workers]
        if temperature == 0:
            chosen = workers[min(range(len(workers)), key=lambda i: (costs[i], workers[i].worker_id))]
        else:
            chosen = workers[_softmax_pick(costs, temperature, seed, request)]
        return decide(snapshot, request, chosen, least_loaded_decode(fitting_decode(snapshot, request)))

    return kv_cost_policy
