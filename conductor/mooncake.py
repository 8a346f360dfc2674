"""``mooncake``, the default policy: Mooncake's KVCache-centric scheduler (FAST'25, Algorithm 1)
with prediction-based early rejection and hot-prefix replication.

For every prefill worker the predicted TTFT of each way to get the prefix (its own, or pulled
from the best holder), the minimum kept; the decode worker with the lowest predicted time
between tokens once the request joins; a rejection with a retry hint when either misses its
SLO. The formulas and the admission modes: docs/architecture.md, "The Mooncake scheduler".
"""

from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple

from conductor.cpp import unit_prefill_s
from conductor.decode_batch import BatchIndex, batch_index
from conductor.routing import (
    ClusterSnapshot,
    DecodeJob,
    Policy,
    PolicyContext,
    Prediction,
    Rejection,
    RejectKind,
    ReusePlan,
    RouteBranch,
    RouteDecision,
    RouteRequest,
    WorkerView,
    admission_rejection,
    best_holder,
    capped_usable,
    decode_need_pages,
    fitting_decode,
    max_reuse_blocks,
    register_policy,
)
from costmodel import CostModels
from kvstore.blocks import Tier

MIN_RETRY_S = 0.5


class PrefillOption(NamedTuple):
    """One way to prefill the request on one worker, with its predicted times (the chosen
    one's; the options weighed are ``OptionRow``s)."""

    worker: WorkerView
    reuse: ReusePlan
    branch: RouteBranch
    queue_s: float
    transfer_s: float
    prefill_s: float  # hand-off included

    @property
    def ttft_s(self) -> float:
        return self.worker.dispatch_s + self.queue_s + self.transfer_s + self.prefill_s


def worker_prefill_s(worker: WorkerView, calibrated_s: float) -> float:
    """A prefill's time on ``worker`` at its pace lately (``conductor.speed``): the calibrated
    engine time x its slowdown, plus the KV hand-off that holds its engine after it."""
    return calibrated_s * worker.slowdown + worker.handoff_s


def queue_s(worker: WorkerView, costs: CostModels) -> float:
    """Predicted seconds until ``worker`` can start a new prefill (its jobs run one at a time),
    at the worker's pace (``worker_prefill_s``, written out: this runs for every busy worker
    of every decision)."""
    slowdown, handoff_s, total = worker.slowdown, worker.handoff_s, 0
    for j in worker.prefill_jobs:
        total += max(0.0, unit_prefill_s(costs, worker, j.num_new_tokens, j.num_reused_tokens) * slowdown + handoff_s
                     - j.elapsed_s)
    return total


def num_holders(snapshot: ClusterSnapshot, request: RouteRequest, num_blocks: int) -> int:
    """Prefill workers that can reuse at least ``num_blocks`` (> 0) leading blocks of the request."""
    assert num_blocks > 0, num_blocks
    return sum(capped_usable(w, request) >= num_blocks for w in snapshot.prefill if w.usable_blocks)


# One option as a row: the argmin's key (TTFT, then the shorter queue, then id, local before
# pull; a worker's two options differ in the last, so rows never compare further), then the
# rest of its ``PrefillOption``. A decision weighs up to two per prefill worker; rows are plain
# tuples, compared by ``min`` in C, and only the chosen one becomes a ``PrefillOption``.
OptionRow = tuple[float, float, str, bool, WorkerView, ReusePlan, RouteBranch, float, float]


def _option(row: OptionRow) -> PrefillOption:
    _, wait, _, _, worker, plan, branch, transfer_s, prefill_s = row
    return PrefillOption(worker, plan, branch, wait, transfer_s, prefill_s)


def _option_rows(snapshot: ClusterSnapshot, request: RouteRequest, costs: CostModels, config) -> list[OptionRow]:
    """Every (worker, local or pull) option of Algorithm 1 as a row (``OptionRow``), in
    snapshot order. What every worker's pull shares (the prefix, its prefill time before the
    worker's speed factor, its transfer time per backend) is predicted once, and so are a plain
    worker's prefill and its own reuse plan of each reuse depth (most workers reuse nothing).
    A row's times are ``PrefillOption``'s, summed in its order."""
    n, bs = request.num_prompt_tokens, request.block_size
    cap = max_reuse_blocks(request)
    best = best_holder(snapshot.prefill, request)
    best_blocks = capped_usable(best, request) if best is not None else 0
    may_replicate = (config.pull_from_peers and best_blocks > 0
                     and num_holders(snapshot, request, best_blocks) < config.max_replicas)
    if may_replicate:
        assert best is not None
        pull_plan = ReusePlan(best_blocks, best.worker_id)
        pull_prefill_s = costs.prefill_s(n - best_blocks * bs, best_blocks * bs)
        pull_tier = best.usable_tier if best.usable_tier is not None else Tier.DRAM
        pull_s_of: dict[str, float] = {}  # by the puller's transfer backend
    rows: list[OptionRow] = []
    single_s: dict[int, float] = {}  # a plain worker's prefill by reuse depth: unit_prefill_s's for cpp_stages 1
    own_plans: dict[int, ReusePlan] = {}  # one frozen plan per reuse depth, shared by the workers at it
    local_branch, cold_branch, pull_branch = RouteBranch.LOCAL, RouteBranch.COLD, RouteBranch.PULL
    for w in snapshot.prefill:
        local = w.usable_blocks
        if local > cap:
            local = cap
        own = own_plans.get(local)
        if own is None:
            own = own_plans[local] = ReusePlan(local, None)
        wait = queue_s(w, costs) if w.prefill_jobs else 0  # most workers of a large cluster: a sum of none
        if w.cpp_stages > 1:
            unit_s = unit_prefill_s(costs, w, n - local * bs, local * bs)
        else:
            unit_s = single_s.get(local)
            if unit_s is None:
                unit_s = single_s[local] = costs.prefill_s(n - local * bs, local * bs)
        slowdown, handoff_s, worker_id = w.slowdown, w.handoff_s, w.worker_id
        start_s = w.dispatch_s + wait
        prefill_s = unit_s * slowdown + handoff_s  # worker_prefill_s, written out (per worker per decision)
        rows.append((start_s + 0.0 + prefill_s, wait, worker_id, False, w, own, local_branch if local else cold_branch,
                     0.0, prefill_s))
        if may_replicate and best.worker_id != worker_id and best_blocks > config.balancing_threshold * local:
            backend = w.transfer_backend
            pull_s = pull_s_of.get(backend)
            if pull_s is None:
                pull_s = pull_s_of[backend] = costs.pull_s(best_blocks * bs, 1, backend=backend, tier=pull_tier)
            pull_prefill = (pull_prefill_s if w.cpp_stages <= 1
                            else unit_prefill_s(costs, w, n - best_blocks * bs, best_blocks * bs))
            prefill_s = pull_prefill * slowdown + handoff_s
            rows.append((start_s + pull_s + prefill_s, wait, worker_id, True, w, pull_plan, pull_branch, pull_s,
                         prefill_s))
    return rows


def prefill_options(snapshot: ClusterSnapshot, request: RouteRequest, costs: CostModels,
                    config) -> list[PrefillOption]:
    """Every (worker, local or pull) option of Algorithm 1, in snapshot order (``_option_rows``)."""
    return [_option(row) for row in _option_rows(snapshot, request, costs, config)]


def choose_prefill(snapshot: ClusterSnapshot, request: RouteRequest, costs: CostModels, config) -> PrefillOption:
    """The minimum-TTFT option, replaced by a replicating pull when the prefix is hot and its
    holder is the bottleneck (see the module docstring)."""
    rows = _option_rows(snapshot, request, costs, config)
    chosen = min(rows)  # by the rows' leading fields (OptionRow)
    _, chosen_wait, _, _, _, chosen_plan, _, _, _ = chosen
    hot = config.hot_prefix_rate_per_s > 0 and snapshot.prefix_rate_per_s >= config.hot_prefix_rate_per_s
    holder_busy = chosen_plan.holder is None and chosen_plan.num_blocks > 0 and chosen_wait > 0
    if not (hot and holder_busy):
        return _option(chosen)
    pulls = [row for row in rows if row[5].holder is not None and row[1] < chosen_wait
             and row[5].num_blocks >= chosen_plan.num_blocks and row[0] <= request.ttft_slo_s]
    if not pulls:
        return _option(chosen)
    best_pull = _option(min(pulls))
    return PrefillOption(best_pull.worker, best_pull.reuse, RouteBranch.REPLICATE, best_pull.queue_s,
                         best_pull.transfer_s, best_pull.prefill_s)


class DecodeBasis(NamedTuple):
    """What a decode worker's batch predictions read of its view before the request's own
    numbers: its known jobs indexed, the running requests (and their context tokens) its
    heartbeat counts beyond them (another Conductor's), and when each known running job leaves
    at its step time now. One per view:
    the policy keeps it while the snapshot hands out the same view (``conductor.snapshot``)."""

    index: BatchIndex
    other: int
    other_tokens: int
    leave_times: tuple[float, ...]  # the index's, at the step time now

    @classmethod
    def of(cls, worker: WorkerView, costs: CostModels) -> DecodeBasis:
        index = batch_index(worker.decode_jobs)
        step_s = costs.decode_step_s(max(1, worker.num_running), worker.num_context_tokens)
        return cls(index, max(0, worker.num_running - index.num_running),
                   max(0, worker.num_context_tokens - index.running_tokens), index.leave_times(step_s))


def _staying(basis: DecodeBasis, request: RouteRequest, at_s: float) -> tuple[int, int]:
    """Batch size and context tokens on the worker ``at_s`` seconds from now, before anyone
    joins: running requests this Conductor does not know, the known running ones that have not
    generated their remaining tokens by then, and this request."""
    num_staying, staying_tokens = basis.index.staying_at(basis.leave_times, at_s)
    return basis.other + num_staying + 1, basis.other_tokens + staying_tokens + request.num_prompt_tokens


def tbt_after_join(worker: WorkerView, request: RouteRequest, costs: CostModels, at_s: float | None,
                   now_s: float = 0.0, until_s: float | None = None) -> float:
    """Predicted decode step time on ``worker`` once this request has joined.

    ``at_s`` None: the batch as it is now (plain early rejection). Otherwise the batch ``at_s``
    seconds from now: known running requests that will have generated their remaining tokens
    by then have left, known requests in prefill that will be ready by ``until_s`` (default
    ``at_s``) have joined; running requests this Conductor does not know (another
    Conductor's) stay. With ``until_s`` the end of this request's decode, that is the largest
    batch it will share while it decodes, as far as this Conductor knows now."""
    if at_s is None:
        return costs.decode_step_s(worker.num_running + 1, worker.num_context_tokens + request.num_prompt_tokens)
    basis = DecodeBasis.of(worker, costs)
    batch, tokens = _staying(basis, request, at_s)
    num_joining, joining_tokens = basis.index.joining(now_s, at_s if until_s is None else until_s)
    return costs.decode_step_s(batch + num_joining, tokens + joining_tokens)


def _retry_hint_s(worker: WorkerView, costs: CostModels, now_s: float) -> float:
    """When the decode worker's batch will have shrunk: the soonest a known request finishes."""
    step_s = costs.decode_step_s(max(1, worker.num_running), worker.num_context_tokens)
    ends = [j.num_remaining_tokens * step_s + j.ready_in_s(now_s) for j in worker.decode_jobs]
    return max(MIN_RETRY_S, min(ends, default=1.0))


def _decode_choice(snapshot: ClusterSnapshot, request: RouteRequest, costs: CostModels, mode: str,
                   ttft_s: float, bases: dict[str, tuple[WorkerView, DecodeBasis]]) -> tuple[WorkerView, float]:
    """The fitting decode worker with the lowest predicted TBT, and that TBT. Worker ids are
    unique, so the minimum never compares the views.

    Predictive: ``tbt_after_join`` at ``ttft_s`` until the end of this request's decode (its
    max tokens at the step time on joining), from each view's basis (``bases``: by worker id,
    the view it was made of and the basis, kept while the snapshots hand out the same view: it
    stays true for a frozen view, and most decode views are the last decision's); the two
    predictions share everything but who joins (written out in one pass, ``_staying`` and
    ``fitting_decode`` included: this runs for every decode worker of every decision)."""
    if mode == "early":
        fitting = fitting_decode(snapshot, request)
        scored = [(tbt_after_join(w, request, costs, None), -w.num_free_pages, w.worker_id, w) for w in fitting]
        tbt, _, _, worker = min(scored)
        return worker, tbt
    now_s, max_tokens, step_s = snapshot.time_s, request.max_tokens, costs.decode_step_s
    need, num_prompt_tokens = decode_need_pages(request), request.num_prompt_tokens
    scored = []
    for w in snapshot.decode:
        free = w.num_free_pages
        if free < need:
            continue
        hit = bases.get(w.worker_id)
        if hit is None or hit[0] is not w:
            hit = bases[w.worker_id] = (w, DecodeBasis.of(w, costs))
        index, other, other_tokens, leave_times = hit[1]
        first = bisect_right(leave_times, ttft_s)  # the running jobs leaving by then (_staying)
        batch = other + index.num_running - first + 1
        tokens = other_tokens + index.tokens_from[first] + num_prompt_tokens
        if not index.ready_at_s:  # nobody joins, then or later: both predictions are this one
            tbt = step_s(batch, tokens)
        else:
            num_joining, joining_tokens = index.joining(now_s, ttft_s)
            first_s = step_s(batch + num_joining, tokens + joining_tokens)
            num_joining, joining_tokens = index.joining(now_s, ttft_s + max_tokens * first_s)
            tbt = step_s(batch + num_joining, tokens + joining_tokens)
        scored.append((tbt, -free, w.worker_id, w))
    tbt, _, _, worker = min(scored)
    return worker, tbt


def make_mooncake(context: PolicyContext) -> Policy:
    if context.costs is None:
        raise ValueError("the mooncake policy needs cost models (a calibration from `tidekv calibrate`)")
    costs, config = context.costs, context.routing
    bases: dict[str, tuple[WorkerView, DecodeBasis]] = {}  # see _decode_choice

    def mooncake(snapshot: ClusterSnapshot, request: RouteRequest) -> RouteDecision | Rejection:
        rejection = admission_rejection(snapshot, request)
        if rejection is not None:
            return rejection
        option = choose_prefill(snapshot, request, costs, config)
        decode, tbt = _decode_choice(snapshot, request, costs, config.admission_mode, option.ttft_s, bases)
        if option.ttft_s > request.ttft_slo_s:
            return Rejection(
                f"predicted TTFT {option.ttft_s:.3f}s misses the {request.ttft_slo_s:g}s SLO: best is "
                f"{option.worker.worker_id} with {option.worker.dispatch_s:.3f}s dispatch + {option.queue_s:.3f}s "
                f"queued + {option.transfer_s:.3f}s transfer + {option.prefill_s:.3f}s prefill",
                max(MIN_RETRY_S, option.ttft_s - request.ttft_slo_s), RejectKind.TTFT_SLO)
        if config.admission_mode != "none" and tbt > request.tbt_slo_s:
            return Rejection(
                f"predicted TBT {tbt * 1e3:.1f}ms misses the {request.tbt_slo_s * 1e3:g}ms SLO on every decode "
                f"worker (best {decode.worker_id}: {decode.num_running} running)",
                _retry_hint_s(decode, costs, snapshot.time_s), RejectKind.TBT_SLO)
        w = option.worker
        predicted = Prediction(option.ttft_s, option.queue_s, option.prefill_s, option.transfer_s, tbt,
                               slowdown=w.slowdown, handoff_s=w.handoff_s, dispatch_s=w.dispatch_s)
        return RouteDecision(option.worker.worker_id, decode.worker_id, option.reuse, option.branch, predicted)

    return mooncake


register_policy("mooncake")(make_mooncake)

__all__ = ["DecodeJob", "PrefillOption", "choose_prefill", "make_mooncake", "prefill_options", "queue_s",
           "tbt_after_join", "worker_prefill_s"]
