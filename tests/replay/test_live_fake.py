"""The live replay's accounting against a scripted in-process Inference server: every gRPC
outcome (finished, rejected with a retry hint, failed terminal, broken stream, error status,
deadline) becomes exactly one record; an unreachable endpoint fails every request, none missing."""

import io
import os
import signal
import threading
from concurrent import futures

import grpc
import pytest

from deploy.local import free_port
from proto import inference_pb2 as pb
from proto import inference_pb2_grpc as pgrpc
from replay.live import run_live_replay, to_proto
from replay.transform import ReplayRequest


class Scripted(pgrpc.InferenceServicer):
    """Behaviour by the request's trace index (the suffix of the request id)."""

    def __init__(self):
        self.seen: list[pb.GenerateRequest] = []

    def Generate(self, request, context):
        self.seen.append(request)
        kind = int(request.request_id.rsplit("-", 1)[1]) % 6
        usage = pb.Usage(prompt_tokens=len(request.token_ids.ids), cached_tokens=16, loaded_cached_tokens=16)
        if kind == 1:
            context.set_trailing_metadata((("retry-after-s", "2.5"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        first = pb.GenerateResponse(request_id=request.request_id, token_ids=[5, 6], usage=usage,
                                    prefill_worker="prefill-0", decode_worker="decode-0")
        yield first
        if kind == 0:
            yield pb.GenerateResponse(token_ids=[7])
            yield pb.GenerateResponse(token_ids=[8], finish_reason=pb.FINISH_REASON_LENGTH, usage=usage,
                                      timing=pb.Timing(queue_s=0.01, ttft_s=0.02, prefill_worker_s=0.015))
        elif kind == 2:
            yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_FAILED, error="decode worker died")
        elif kind == 3:
            return  # no terminal message
        elif kind == 4:
            context.abort(grpc.StatusCode.INTERNAL, "kaput")
        else:  # a refusal, as the Conductor makes one (a replica that died is failed over instead)
            context.set_trailing_metadata((("reject-reason", "no_workers"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker")


@pytest.fixture()
def scripted():
    servicer = Scripted()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pgrpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0).wait()


def requests(n: int, **kw) -> list[ReplayRequest]:
    return [ReplayRequest(request_id=f"t{i}", index=i, arrival_s=0.01 * i, prompt_len=3,
                          prompt_ids=(1, 2, 3), max_tokens=4, **kw)
            for i in range(n)]


def test_every_outcome_is_one_record(scripted, tmp_path):
    servicer, endpoint = scripted
    stream = io.StringIO()
    result = run_live_replay(requests(12), endpoint, max_concurrency=3, out_dir=tmp_path / "r", plots=False,
                             progress_stream=stream)
    recs = result.records
    assert [r.index for r in recs] == list(range(12)) and len(servicer.seen) == 12
    outcomes = [(r.outcome, r.status) for r in recs[:6]]
    assert outcomes == [("finished", "OK"), ("rejected", "RESOURCE_EXHAUSTED"), ("failed", "OK"), ("failed", "OK"),
                        ("failed", "INTERNAL"), ("failed", "UNAVAILABLE")]
    assert outcomes == [(r.outcome, r.status) for r in recs[6:]]
    done = recs[0]
    assert done.finish_reason == "length" and done.num_output_tokens == 4 and done.token_times_s[0] == done.ttft_s
    assert done.token_times_s[0] == done.token_times_s[1]  # two tokens of one message share its time
    assert (done.prompt_tokens, done.cached_tokens, done.queue_s) == (3, 16, 0.01)
    assert (done.loaded_cached_tokens, done.prefill_worker_s) == (16, 0.015)
    assert (done.prefill_worker, done.decode_worker) == ("prefill-0", "decode-0")
    assert done.server_request_id.endswith("-0") and done.source == "live"
    assert recs[1].retry_after_s == 2.5 and "queue full" in recs[1].error
    assert recs[2].error == "decode worker died"
    assert "0 terminal messages" in recs[3].error and "kaput" in recs[4].error
    c = result.summary.counts
    assert (c.total, c.finished, c.rejected, c.failed, c.cancelled) == (12, 2, 2, 8, 0)
    assert (tmp_path / "r" / "requests.jsonl").read_text().count("\n") == 12
    assert "done 12/12 (finished 2, rejected 2, failed 8, cancelled 0)" in stream.getvalue()


def test_slos_are_sent_when_the_proto_has_them(scripted):
    servicer, endpoint = scripted
    run_live_replay(requests(1, ttft_slo_s=0.5, tbt_slo_s=0.05), endpoint, max_concurrency=1, progress=False)
    (seen,) = servicer.seen
    assert list(seen.token_ids.ids) == [1, 2, 3] and seen.sampling.max_tokens == 4
    if "ttft_slo_s" in pb.GenerateRequest.DESCRIPTOR.fields_by_name:
        assert (seen.ttft_slo_s, seen.tbt_slo_s) == (0.5, 0.05)
    plain = to_proto(requests(1)[0], "x-0")
    if "ttft_slo_s" in pb.GenerateRequest.DESCRIPTOR.fields_by_name:
        assert plain.ttft_slo_s == 0.0 and plain.tbt_slo_s == 0.0


class Hanging(pgrpc.InferenceServicer):
    """One token, then holds the stream open until the client goes away (cancel or deadline)."""

    def Generate(self, request, context):
        gone = threading.Event()
        context.add_callback(gone.set)
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[5], prefill_worker="prefill-0")
        gone.wait(30)


@pytest.fixture()
def hanging():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pgrpc.add_InferenceServicer_to_server(Hanging(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0).wait()


def test_deadline_is_a_failure_with_the_tokens_so_far(hanging):
    (r,) = run_live_replay(requests(1), hanging, max_concurrency=1, timeout_s=0.5, progress=False).records
    assert (r.outcome, r.status, r.num_output_tokens) == ("failed", "DEADLINE_EXCEEDED", 1)


def test_interrupt_cancels_in_flight_and_unsent_requests(hanging):
    reqs = requests(2) + [ReplayRequest(request_id=f"t{i}", index=i, arrival_s=60.0, prompt_len=1,
                                        prompt_ids=(1,), max_tokens=2)
                          for i in range(2, 5)]
    # A real SIGINT (Ctrl-C) while two requests hang and three wait for their arrival time,
    # under Python's own Ctrl-C handler (a library an earlier test loaded may have left another).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        result = run_live_replay(reqs, hanging, max_concurrency=4, timeout_s=30, progress=False)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert [r.outcome for r in result.records] == ["cancelled"] * 5, [(r.outcome, r.error) for r in result.records]
    assert result.summary.counts.cancelled == 5 and result.summary.run["interrupted"] is True


def test_unreachable_endpoint_fails_every_request_none_missing():
    result = run_live_replay(requests(5), f"127.0.0.1:{free_port()}", max_concurrency=2, timeout_s=2,
                             progress=False)
    assert [r.outcome for r in result.records] == ["failed"] * 5
    assert {r.status for r in result.records} == {"UNAVAILABLE"}
    assert result.summary.counts.failed == 5 and result.summary.counts.total == 5


def test_unmaterialised_requests_are_refused():
    r = ReplayRequest(request_id="t0", index=0, arrival_s=0.0, prompt_len=16, max_tokens=1, hash_ids=(1,),
                      tokens_per_block=16)
    with pytest.raises(ValueError, match="request t0 has no prompt tokens"):
        run_live_replay([r], "127.0.0.1:1", progress=False)


def test_progress_never_shows_more_started_than_handed_over():
    """A sender may start a request the moment it is submitted: the dispatcher counts it as
    handed over first, so the line's 'waiting' (handed over, not yet started) is never -1."""
    from concurrent.futures import Future

    from replay.live import _dispatch
    from replay.progress import ReplayProgress
    from replay.records import RequestRecord

    progress = ReplayProgress(3, None)
    lines: list[str] = []

    class InlinePool:  # runs each request on submit, as a free sender thread may
        def submit(self, fn, r):
            fut: Future = Future()
            fut.set_result(fn(r))
            return fut

    class Sender:
        stopping = threading.Event()

        def now_s(self) -> float:
            return 10.0  # every arrival is due

        def send(self, r: ReplayRequest) -> RequestRecord:
            progress.started()
            lines.append(progress.line())
            return RequestRecord(request_id=r.request_id, index=r.index, source="live", outcome="finished",
                                 scheduled_s=r.arrival_s, arrival_s=r.arrival_s, prompt_len=r.prompt_len,
                                 max_tokens=r.max_tokens)

    requests = [ReplayRequest(f"r{i}", i, 0.1 * i, 3, 4, prompt_ids=(1, 2, 3)) for i in range(3)]
    futures_: list = [None] * 3
    _dispatch(Sender(), requests, InlinePool(), progress, futures_)
    assert len(lines) == 3 and all("waiting 0," in line for line in lines), lines
    assert "done 3/3" in progress.line() and "waiting 0," in progress.line()
