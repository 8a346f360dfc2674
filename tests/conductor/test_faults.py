"""The lifecycle under worker faults, without gRPC or processes: the pure rules (migrate?
how long may a prefill attempt take?) and ``RequestLife`` over a scripted dispatcher whose
"model" is a pure function of the context, so the uninterrupted run is known exactly.
Every scenario checks the tokens, the one terminal message and an empty pending overlay."""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import pytest

import engine
from clusterstate.workers import WorkerInfo, WorkerLoad, WorkerRole
from conductor.clock import ManualClock
from conductor.config import SLO, ConductorConfig, SLOTable
from conductor.core import ConductorCore, _without
from conductor.dispatch import (
    STALL_SLACK,
    DecodeChunk,
    DispatchError,
    FailureKind,
    PrefillCall,
    PrefillResult,
    prefill_timeout_s,
    should_migrate,
)
from conductor.grpc_dispatch import failure_kind
from conductor.lifecycle import Aborted, Refused, RequestLife
from conductor.pending import PendingWork
from conductor.routing import PolicyContext, make_policy
from conductor.snapshot import RegistryEntry, build_snapshot
from conductor.validation import ValidRequest
from costmodel import CostModels
from engine.sampler import SamplingParams
from proto import inference_pb2 as pb
from tests.conductor.test_core import StaticCluster

BS = 16
TOKEN_S = 0.01  # scripted time per decoded token
COSTS = CostModels.analytic(prefill_s_per_token=1e-3, decode_base_s=0.01, decode_s_per_request=1e-3)


def next_token(context: list[int]) -> int:
    """The scripted model: the next token is a pure function of everything before it."""
    return (sum(context) * 31 + len(context) * 7) % 97 + 1


def reference(prompt: list[int], max_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
    context, out = list(prompt), []
    while len(out) < max_tokens and not (out and out[-1] in stop):
        out.append(next_token(context))
        context.append(out[-1])
    return out


def static_cluster(worker_ids: tuple[str, ...]) -> StaticCluster:
    """Workers named p* (prefill) and d* (decode), each with room, never changing."""
    def info(w: str) -> WorkerInfo:
        role = WorkerRole.PREFILL if w.startswith("p") else WorkerRole.DECODE
        return WorkerInfo(w, role, f"rpc-{w}", 1000, transfer_address=f"tcp://{w}")

    return StaticCluster(tuple(RegistryEntry(info(w), WorkerLoad(num_free_pages=1000)) for w in worker_ids))


class ScriptedDispatcher:
    """Workers that follow ``next_token``. ``dead``: decode workers that refuse reservations;
    ``break_after[d]``: d's stream breaks (UNAVAILABLE) after that many tokens, and
    ``before_finish`` makes it break after its last token instead, before the finish;
    ``hung``: prefill workers that never answer (the attempt ends STALLED at its bound)."""

    def __init__(self, clock: ManualClock):
        self.clock = clock
        self.dead: set[str] = set()
        self.hung: set[str] = set()
        self.fail_once: dict[str, FailureKind] = {}  # prefill worker -> the failure of its next prefill
        self.break_after: dict[str, int] = {}
        self.before_finish: set[str] = set()
        self.prefills: list[tuple[str, PrefillCall]] = []
        self.on_prefill = None  # called before each prefill, with its number (0: the first)
        self.reserved: dict[tuple[str, str], tuple[int, int]] = {}  # (worker, id) -> (prompt, max tokens)
        self.reserved_ever: list[tuple[str, str]] = []
        self._context: dict[str, list[int]] = {}

    def reserve(self, decode_worker: str, request_id: str, num_prompt_tokens: int, max_tokens: int,
                deadline_s: float) -> str:
        if decode_worker in self.dead:
            raise DispatchError(FailureKind.UNAVAILABLE, decode_worker, "connection refused")
        self.reserved[(decode_worker, request_id)] = (num_prompt_tokens, max_tokens)
        self.reserved_ever.append((decode_worker, request_id))
        return f"tcp://{decode_worker}"

    def prefill(self, prefill_worker: str, call: PrefillCall, on_cancel) -> PrefillResult:
        self.prefills.append((prefill_worker, call))
        if self.on_prefill is not None and self.on_prefill(len(self.prefills) - 1):
            raise DispatchError(FailureKind.CANCELLED, prefill_worker, "prefill cancelled")
        if prefill_worker in self.fail_once:
            raise DispatchError(self.fail_once.pop(prefill_worker), prefill_worker, "scripted failure")
        if prefill_worker in self.hung:
            assert call.timeout_s < call.deadline_s, "a hung worker must be bounded before the deadline"
            self.clock.advance(call.timeout_s)
            raise DispatchError(FailureKind.STALLED, prefill_worker, "prefill unanswered; cancelled")
        self._context[call.placement_id] = list(call.token_ids)
        return PrefillResult(next_token(list(call.token_ids)), 0, 0.001)

    def decode(self, decode_worker: str, request_id: str, first_token: int, sampling: SamplingParams,
               num_prompt_tokens: int, deadline_s: float, on_cancel) -> Iterator[DecodeChunk]:
        context = self._context[request_id]
        assert len(context) == num_prompt_tokens, (len(context), num_prompt_tokens)
        assert self.reserved.pop((decode_worker, request_id)) == (num_prompt_tokens, sampling.max_new_tokens)
        context.append(first_token)
        start, num_generated, num_streamed = self.clock.now(), 1, 0
        while True:
            if num_streamed == self.break_after.get(decode_worker, -1):
                raise DispatchError(FailureKind.UNAVAILABLE, decode_worker, "decode failed: Socket closed")
            self.clock.advance(TOKEN_S)
            if self.clock.now() - start > deadline_s:
                raise DispatchError(FailureKind.DEADLINE, decode_worker, "decode failed: Deadline Exceeded")
            token = next_token(context)
            context.append(token)
            num_generated += 1
            num_streamed += 1
            yield DecodeChunk((token,))
            done = token in sampling.stop_token_ids or num_generated >= sampling.max_new_tokens
            if done and decode_worker in self.before_finish:
                raise DispatchError(FailureKind.UNAVAILABLE, decode_worker, "decode failed: Socket closed")
            if token in sampling.stop_token_ids:
                yield DecodeChunk((), pb.FINISH_REASON_STOP)
                return
            if num_generated >= sampling.max_new_tokens:
                yield DecodeChunk((), pb.FINISH_REASON_LENGTH)
                return

    def release(self, decode_worker: str, request_id: str) -> None:
        self.reserved.pop((decode_worker, request_id), None)


class Harness:
    def __init__(self, workers=("p0", "p1", "d0", "d1"), policy: str = "round_robin", max_migrations: int = 2,
                 prefill_timeout_s: float = 0.0):
        self.clock = ManualClock()
        self.core = ConductorCore(static_cluster(workers), make_policy(policy, PolicyContext(costs=COSTS)),
                                  SLOTable(SLO(60, 1)), self.clock)
        self.dispatcher = ScriptedDispatcher(self.clock)
        self.tokenizer = engine.load_tokenizer("tiny")
        self.max_migrations, self.prefill_timeout_s = max_migrations, prefill_timeout_s
        self._seq = 0

    def life(self, prompt: list[int], max_tokens: int, stop: tuple[int, ...] = (), deadline_s: float = 60.0,
             client_deadline_s: float | None = None, max_attempts: int = 2,
             resumed: tuple[int, ...] = ()) -> RequestLife:
        params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=stop)
        req = ValidRequest(tuple(prompt), params, deadline_s, "", resumed=resumed)
        seq, self._seq = self._seq, self._seq + 1  # round robin: request 0 goes to p0 and d0
        return RequestLife(self.core, self.dispatcher, self.tokenizer, req, f"r{seq}", seq, max_attempts,
                           max_migrations=self.max_migrations, prefill_timeout_s=self.prefill_timeout_s,
                           client_deadline_s=client_deadline_s)

    def run(self, life: RequestLife) -> list[pb.GenerateResponse]:
        msgs = list(life.run())
        assert [m for m in msgs if m.finish_reason] == msgs[-1:], "exactly one terminal message, the last"
        assert len(self.core.pending) == 0 and not self.dispatcher.reserved
        assert "".join(m.text for m in msgs) == self.tokenizer.decode(tokens(msgs))
        return msgs


def tokens(msgs: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


PROMPT = [(i * 13) % 200 + 1 for i in range(40)]


# --- the pure rules ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(FailureKind))
def test_only_a_stream_the_worker_broke_is_migrated_while_migrations_remain(kind: FailureKind) -> None:
    migratable = kind in (FailureKind.UNAVAILABLE, FailureKind.TRANSFER, FailureKind.INTERNAL, FailureKind.STALLED)
    assert should_migrate(kind, 0, 2, cancelled=False) is migratable
    assert should_migrate(kind, 1, 2, cancelled=False) is migratable
    assert should_migrate(kind, 2, 2, cancelled=False) is False
    assert should_migrate(kind, 0, 2, cancelled=True) is False


@pytest.mark.parametrize(("code", "details", "kind"), [
    (grpc.StatusCode.UNKNOWN, "Stream removed", FailureKind.UNAVAILABLE),  # the worker died mid-call
    (grpc.StatusCode.INTERNAL, "Socket closed", FailureKind.UNAVAILABLE),
    (grpc.StatusCode.UNAVAILABLE, "KV transfer to decode worker failed", FailureKind.TRANSFER),
    (grpc.StatusCode.UNKNOWN, "Exception calling application: boom", FailureKind.INTERNAL),
    (grpc.StatusCode.INTERNAL, "prefill failed: bad block", FailureKind.INTERNAL),
])
def test_a_connection_lost_mid_call_is_unavailable_whatever_code_grpc_gave(code, details, kind) -> None:
    assert failure_kind(code, details) is kind


def test_without_leaves_out_the_most_recent_failures_first() -> None:
    ws = tuple(static_cluster(("p0", "p1", "p2")).registry_view(0.0))
    views = build_snapshot(ws, None, PendingWork().view(), 0.0).prefill
    names = lambda avoid: [w.worker_id for w in _without(views, avoid)]  # noqa: E731
    assert names(()) == ["p0", "p1", "p2"]
    assert names(("p1", "d0")) == ["p0", "p2"]
    assert names(("p0", "p1", "p2")) == ["p0"]  # p0 failed longest ago: allowed again first
    assert names(("p2", "d0", "p0", "p1")) == ["p2"]


def test_a_third_attempt_returns_to_the_worker_that_failed_longest_ago() -> None:
    """A failed KV push blames both ends; a prefill worker that stalls only itself. With both
    prefill workers failed, the third attempt goes back to the earlier one, and keeps away
    from the decode worker the push failed to."""
    h = Harness(prefill_timeout_s=1.0)
    h.dispatcher.fail_once["p0"] = FailureKind.TRANSFER
    h.dispatcher.hung.add("p1")
    msgs = h.run(h.life(PROMPT, 4, max_attempts=3))
    assert tokens(msgs) == reference(PROMPT, 4)
    assert [w for w, _ in h.dispatcher.prefills] == ["p0", "p1", "p0"]
    assert h.dispatcher.reserved_ever[-1][0] == "d1"


def test_a_prefill_attempt_is_bounded_by_the_floor_or_the_predicted_ttft() -> None:
    assert prefill_timeout_s(30.0, 0.0) == 30.0  # a policy that predicts nothing: the floor
    assert prefill_timeout_s(30.0, 1.0) == 30.0
    assert prefill_timeout_s(30.0, 20.0) == STALL_SLACK * 20.0  # a long predicted queue raises it
    assert prefill_timeout_s(0.0, 20.0) == math.inf  # off: the deadline alone
    with pytest.raises(ValueError, match="floor_s -1"):
        prefill_timeout_s(-1.0, 0.0)


def test_fault_settings_are_validated() -> None:
    assert ConductorConfig().max_decode_migrations == 2 and ConductorConfig().prefill_timeout_s > 0
    with pytest.raises(ValueError, match="max_decode_migrations -1"):
        ConductorConfig(max_decode_migrations=-1)


# --- decode migration --------------------------------------------------------------------------


def test_a_lost_decode_worker_is_replaced_and_the_stream_goes_on_exactly() -> None:
    h = Harness()
    h.dispatcher.break_after["d0"] = 7  # round robin: the first request decodes on d0
    msgs = h.run(h.life(PROMPT, 30))
    assert tokens(msgs) == reference(PROMPT, 30)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert msgs[0].decode_worker == "d0"
    assert [m.decode_worker for m in msgs[1:] if m.decode_worker] == ["d1"]
    assert msgs[-1].usage.prompt_tokens == len(PROMPT) and msgs[-1].usage.completion_tokens == 30
    # the continuation's prefill: the prompt and the 8 tokens sent (the first and 7 decoded)
    worker, call = h.dispatcher.prefills[-1]
    assert call.token_ids == tuple(PROMPT) + tuple(reference(PROMPT, 8))


def test_a_stop_token_after_a_migration_ends_the_request() -> None:
    h = Harness()
    ref = reference(PROMPT, 30)
    stop = ref[20]
    stop_at = ref.index(stop)
    h.dispatcher.break_after["d0"] = 5  # 6 sent before the migration
    assert stop_at > 6
    msgs = h.run(h.life(PROMPT, 30, stop=(stop,)))
    assert tokens(msgs) == ref[: stop_at + 1] == reference(PROMPT, 30, (stop,))
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP


def test_a_stream_lost_after_its_last_token_ends_without_a_migration() -> None:
    h = Harness()
    h.dispatcher.before_finish.add("d0")
    msgs = h.run(h.life(PROMPT, 12))
    assert tokens(msgs) == reference(PROMPT, 12) and msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(h.dispatcher.prefills) == 1


def test_a_migration_whose_first_token_is_the_last_ends_there() -> None:
    h = Harness()
    h.dispatcher.break_after["d0"] = 10  # 11 sent of 12: the continuation's prefill makes the 12th
    msgs = h.run(h.life(PROMPT, 12))
    assert tokens(msgs) == reference(PROMPT, 12) and msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(h.dispatcher.prefills) == 2


def test_a_resumed_stream_goes_on_after_the_tokens_a_failed_conductor_sent() -> None:
    h = Harness()
    ref = reference(PROMPT, 12)
    msgs = h.run(h.life(PROMPT, 12, resumed=tuple(ref[:5])))
    assert ref[:5] + tokens(msgs) == ref and msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == 12


@pytest.mark.parametrize("why", ["length", "stop"])
def test_a_resume_after_the_last_token_ends_at_once_without_a_placement(why: str) -> None:
    """The failed Conductor sent the last token and broke before the finish: the resumed call
    only finishes (CI saw the max_tokens case refused as INVALID_ARGUMENT)."""
    h = Harness()
    ref = reference(PROMPT, 12)
    sent, stop = (ref, ()) if why == "length" else (ref[:6], (ref[5],))
    msgs = h.run(h.life(PROMPT, 12, stop=stop, resumed=tuple(sent)))
    assert tokens(msgs) == [] and len(msgs) == 1
    assert msgs[0].finish_reason == (pb.FINISH_REASON_LENGTH if why == "length" else pb.FINISH_REASON_STOP)
    assert msgs[0].usage.completion_tokens == len(sent)
    assert h.dispatcher.prefills == []


def test_without_another_decode_worker_the_request_fails_with_the_reason() -> None:
    h = Harness(workers=("p0", "d0"))
    h.dispatcher.break_after["d0"] = 3
    msgs = h.run(h.life(PROMPT, 30))
    assert tokens(msgs) == reference(PROMPT, 4)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_FAILED
    assert msgs[-1].error.startswith("decode worker d0 lost after 4 tokens")
    assert "no other decode worker" in msgs[-1].error


def test_migrations_are_bounded() -> None:
    h = Harness(workers=("p0", "d0", "d1", "d2"), max_migrations=1)
    h.dispatcher.break_after.update(d0=3, d1=3, d2=3)
    msgs = h.run(h.life(PROMPT, 30))
    assert tokens(msgs) == reference(PROMPT, 8)  # 4 on the first worker, 4 on the second
    assert msgs[-1].finish_reason == pb.FINISH_REASON_FAILED and "no migrations left (1 allowed)" in msgs[-1].error


def test_a_continuation_that_cannot_reserve_is_retried_on_a_live_worker() -> None:
    h = Harness(workers=("p0", "d0", "d1", "d2"))
    h.dispatcher.break_after["d0"] = 3
    h.dispatcher.dead.add("d1")  # still registered, refuses the reservation
    msgs = h.run(h.life(PROMPT, 20))
    assert tokens(msgs) == reference(PROMPT, 20) and msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [m.decode_worker for m in msgs[1:] if m.decode_worker] == ["d2"]


def test_a_client_leaving_during_a_migration_cancels_it_and_frees_everything() -> None:
    h = Harness()
    h.dispatcher.break_after["d0"] = 3
    life = h.life(PROMPT, 30)

    def leave(n: int) -> bool:
        if n == 1:  # the continuation's prefill: its reservation on d1 is held
            assert ("d1", f"{life.request_id}/1") in h.dispatcher.reserved  # the second placement's id
            life.cancel()  # runs the cancel hooks: the reservation is released
        return life.cancelled

    h.dispatcher.on_prefill = leave
    msgs = h.run(life)  # checks: no reservation held, nothing pending
    assert msgs[-1].finish_reason == pb.FINISH_REASON_CANCELLED and tokens(msgs) == reference(PROMPT, 4)
    assert len(h.dispatcher.prefills) == 2


# --- hung prefill workers ------------------------------------------------------------------------


def test_a_hung_prefill_worker_is_left_for_another_one() -> None:
    h = Harness(prefill_timeout_s=5.0)
    h.dispatcher.hung.add("p0")  # round robin sends the first request there
    msgs = h.run(h.life(PROMPT, 6))
    assert tokens(msgs) == reference(PROMPT, 6) and msgs[0].prefill_worker == "p1"
    assert [(w, c.timeout_s) for w, c in h.dispatcher.prefills] == [("p0", 5.0), ("p1", 5.0)]


# --- deadlines ---------------------------------------------------------------------------------


def test_a_predicted_ttft_past_the_deadline_is_refused_at_once() -> None:
    h = Harness(policy="mooncake")
    long_prompt = [(i * 7) % 200 + 1 for i in range(2000)]  # 2 s predicted at 1 ms a token
    for kwargs, name in (({"deadline_s": 0.5}, "deadline_s"), ({"client_deadline_s": 0.5}, "client")):
        with pytest.raises(Refused) as refused:
            list(h.life(long_prompt, 4, **kwargs).run())
        assert refused.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and refused.value.reason == "deadline"
        assert "predicted time to first token" in str(refused.value) and name in str(refused.value)
    assert not h.dispatcher.prefills and len(h.core.pending) == 0 and not h.dispatcher.reserved


@pytest.mark.parametrize("which", ["deadline_s", "client"])
def test_a_deadline_passing_mid_stream_aborts_with_deadline_exceeded(which: str) -> None:
    h = Harness()
    kwargs = {"deadline_s": 0.2} if which == "deadline_s" else {"client_deadline_s": 0.2}
    life = h.life(PROMPT, 100, **kwargs)
    msgs = []
    with pytest.raises(Aborted) as aborted:
        for msg in life.run():
            msgs.append(msg)
    assert aborted.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not any(m.finish_reason for m in msgs)
    assert 1 < len(tokens(msgs)) < 100 and tokens(msgs) == reference(PROMPT, len(tokens(msgs)))
    assert len(h.core.pending) == 0


def test_each_placement_goes_by_its_own_id_on_the_workers() -> None:
    """A retry or migration never reuses the id of an abandoned placement, so late frames of
    an earlier prefill cannot land in the new reservation; snapshots map ids back."""
    from conductor.dispatch import placement_id, request_of

    assert placement_id("r0", 0) == "r0" and placement_id("r0", 2) == "r0/2"
    assert request_of("r0/2") == request_of("r0") == "r0"
    h = Harness(workers=("p0", "d0", "d1"))
    h.dispatcher.break_after["d0"] = 3
    life = h.life(PROMPT, 20)
    h.run(life)
    assert {rid for _, rid in h.dispatcher.reserved_ever} == {"r0", "r0/1"}


def test_the_stall_watch_cancels_only_silent_streams() -> None:
    from conductor.grpc_dispatch import StallWatch

    now = [0.0]
    watch = StallWatch(2.0, clock=lambda: now[0])
    cancelled: list[str] = []
    quiet, busy = watch.watch(lambda: cancelled.append("quiet")), watch.watch(lambda: cancelled.append("busy"))
    for _ in range(5):
        now[0] += 1.0
        watch.touch(busy)
        watch.check()
    assert cancelled == ["quiet"]  # once, although checked again after
    assert watch.done(quiet) is True and watch.done(busy) is False
