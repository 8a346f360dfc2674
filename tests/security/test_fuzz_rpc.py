"""Fuzzing with hypothesis of the public ``Generate`` of a live 1P1D cluster.

Random requests (valid and invalid field values) and random or mutated raw messages end in a
correct stream (one terminal message, STOP or LENGTH, token-exact with the single-process
engine) or INVALID_ARGUMENT, never INTERNAL, UNKNOWN, UNAVAILABLE or a hang; an independent
reading of the proto's field rules says which of the two each request must get. The last test
checks that every process survived the fuzz and its logs hold no traceback.

Every run is derandomized (CI sees the same examples each time) and keeps no example database
(``fuzz_support.fuzz``).
"""

from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import assume, event, given
from hypothesis import strategies as st

import engine
from deploy.local import ClusterConfig, LocalCluster
from proto import inference_pb2 as pb
from proto import inference_pb2_grpc as pgrpc
from runtime.grpc_server import channel
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt
from tests.security.fuzz_support import fuzz, mutate

CFG = engine.load_config("tiny")
VOCAB = CFG.vocab_size
# The Conductor's defaults (conductor.config): the spec the requests below are judged by.
MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, MAX_DEADLINE_S, MAX_SLO_S = 1024, 8000, 3600.0, 3600.0
TOKENIZER = engine.load_tokenizer("tiny")
MAX_REQUEST_ID_LEN, MAX_TENANT_LEN = 48, 128  # request_id in UTF-8 bytes
CALL_TIMEOUT_S = 60.0  # far beyond any request here: running into it is a hang
BAD_FLOATS = (math.nan, math.inf, -math.inf, -1.0, -1e-30, 1e308)
BAD = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def cluster():
    config = ClusterConfig(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS)
    with LocalCluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster):
    ch = channel(cluster.endpoint)
    yield pgrpc.InferenceStub(ch)
    ch.close()


@pytest.fixture(scope="module")
def reference():
    return engine.load_model("tiny")


def _ids(valid_only: bool) -> st.SearchStrategy[list[int]]:
    ok = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
    if valid_only:
        return ok
    out_of_vocab = st.sampled_from([VOCAB, VOCAB + 1, 2**31, 2**32 - 1])
    return st.one_of(ok, st.just([]), st.lists(st.one_of(st.integers(0, VOCAB - 1), out_of_vocab), min_size=1,
                                               max_size=6), st.just([1] * (MAX_PROMPT_TOKENS + 1)))


def _text(valid_only: bool) -> st.SearchStrategy[str]:
    # The tiny model's tokenizer gives one token per character: 12 characters are 12 prompt tokens.
    short = st.text(min_size=1, max_size=12)
    return short if valid_only else st.one_of(short, st.just(""), st.just("\u00e9" * (MAX_PROMPT_TOKENS + 1)))


def _floats(valid: st.SearchStrategy[float], valid_only: bool, *extra: float) -> st.SearchStrategy[float]:
    return valid if valid_only else st.one_of(valid, st.sampled_from(BAD_FLOATS + extra))


@st.composite
def generate_requests(draw, valid_only: bool) -> pb.GenerateRequest:
    """A request whose fields are each drawn valid or (unless ``valid_only``) possibly not:
    valid values stay small (at most 8 new tokens, short prompts) so each call is quick."""
    rid_ok = st.one_of(st.just(""), st.just("r" * MAX_REQUEST_ID_LEN),
                       st.text(st.characters(exclude_characters="/", exclude_categories=("Cs",)),
                               max_size=MAX_REQUEST_ID_LEN).filter(lambda rid: len(rid.encode()) <= MAX_REQUEST_ID_LEN))
    rid_bad = st.one_of(st.text(min_size=MAX_REQUEST_ID_LEN + 1, max_size=200),
                        st.just("\u00e9" * 30),  # 30 characters, 60 bytes
                        st.text(max_size=10).map(lambda s: s + "/" + s))
    tenant_ok = st.one_of(st.just(""), st.text(max_size=12), st.just("t" * MAX_TENANT_LEN))
    tenant_bad = st.text(min_size=MAX_TENANT_LEN + 1, max_size=300)
    tokens_ok = st.integers(1, 8)
    tokens_bad = st.sampled_from([0, MAX_NEW_TOKENS + 1, VOCAB, 2**32 - 1])
    top_k_bad = st.sampled_from([VOCAB + 1, 2**32 - 1])
    seed_bad = st.sampled_from([2**63, 2**64 - 1])
    stop_bad = st.lists(st.sampled_from([VOCAB, 2**32 - 1]), min_size=1, max_size=2)
    if not valid_only:
        rid_ok, tenant_ok = st.one_of(rid_ok, rid_bad), st.one_of(tenant_ok, tenant_bad)
        tokens_ok = st.one_of(tokens_ok, tokens_bad)
    req = pb.GenerateRequest(request_id=draw(rid_ok), tenant=draw(tenant_ok))
    which = draw(st.sampled_from(["ids", "text"] if valid_only else ["ids", "text", "none"]))
    if which == "ids":
        req.token_ids.ids.extend(draw(_ids(valid_only)))
    elif which == "text":
        req.text = draw(_text(valid_only))
    s = req.sampling
    s.max_tokens = draw(tokens_ok)
    # A positive temperature far below 0.1 divides logits into infinities, where the test
    # process (denormals flushed) and the workers need not agree bit for bit: kept for the
    # invalid-input run, which does not compare tokens.
    s.temperature = draw(st.one_of(st.just(0.0), _floats(st.floats(0.1, 2.0), valid_only, 100.5)))
    s.top_p = draw(st.one_of(st.just(0.0), _floats(st.floats(0.05, 1.0), valid_only, 1.5)))
    s.top_k = draw(st.one_of(st.just(0), st.integers(1, 50), st.just(VOCAB),
                             *(() if valid_only else (top_k_bad,))))
    s.seed = draw(st.integers(0, 2**63 - 1) if valid_only else st.one_of(st.integers(0, 2**63 - 1), seed_bad))
    stop_ok = st.lists(st.integers(0, VOCAB - 1), max_size=3)
    s.stop_token_ids.extend(draw(stop_ok if valid_only else st.one_of(stop_ok, stop_bad)))
    req.deadline_s = draw(_floats(st.one_of(st.just(0.0), st.floats(30.0, MAX_DEADLINE_S)), valid_only,
                                  MAX_DEADLINE_S * 1.0001, 1e-9, 1e-4))
    for name in ("ttft_slo_s", "tbt_slo_s"):
        setattr(req, name, draw(_floats(st.one_of(st.just(0.0), st.floats(60.0, MAX_SLO_S)), valid_only,
                                        MAX_SLO_S * 1.0001, 1e-9)))
    return req


def prompt_ids(req: pb.GenerateRequest) -> list[int]:
    return TOKENIZER.encode(req.text) if req.WhichOneof("prompt") == "text" else list(req.token_ids.ids)


def problems(req: pb.GenerateRequest) -> list[str]:
    """The fields the proto's comments and the Conductor's limits make invalid (read from the
    message, so floats are judged after their float32 rounding), independently of
    ``conductor.validation``."""
    s, ids = req.sampling, prompt_ids(req)
    limit = min(MAX_NEW_TOKENS, CFG.max_seq_len - len(ids))
    checks = {
        "request_id": len(req.request_id.encode()) <= MAX_REQUEST_ID_LEN and "/" not in req.request_id,
        "tenant": len(req.tenant) <= MAX_TENANT_LEN,
        "prompt": 1 <= len(ids) <= min(MAX_PROMPT_TOKENS, CFG.max_seq_len - 1) and all(i < VOCAB for i in ids),
        "max_tokens": 1 <= s.max_tokens <= limit,
        "temperature": 0.0 <= s.temperature <= 100.0,  # NaN fails every comparison
        "top_p": s.top_p == 0.0 or 0.0 < s.top_p <= 1.0,
        "top_k": s.top_k <= VOCAB,
        "seed": s.seed < 2**63,
        "stop_token_ids": all(t < VOCAB for t in s.stop_token_ids),
        "deadline_s": 0.0 <= req.deadline_s <= MAX_DEADLINE_S,
        "ttft_slo_s": 0.0 <= req.ttft_slo_s <= MAX_SLO_S,
        "tbt_slo_s": 0.0 <= req.tbt_slo_s <= MAX_SLO_S,
    }
    return [name for name, ok in checks.items() if not ok]


def excusable(req: pb.GenerateRequest) -> set[grpc.StatusCode]:
    """Statuses a valid request may end with besides a stream, and why: a deadline under a
    millisecond passes before the first token (DEADLINE_EXCEEDED, the server's own deadline);
    an SLO under a millisecond is one the SLO-aware router predicts it cannot meet and refuses
    (RESOURCE_EXHAUSTED with a retry-after, conductor.mooncake)."""
    codes = set()
    if 0.0 < req.deadline_s < 1e-3:
        codes.add(grpc.StatusCode.DEADLINE_EXCEEDED)
    if 0.0 < req.ttft_slo_s < 1e-3 or 0.0 < req.tbt_slo_s < 1e-3:
        codes.add(grpc.StatusCode.RESOURCE_EXHAUSTED)
    return codes


def check_stream(messages: list[pb.GenerateResponse], req: pb.GenerateRequest) -> list[int]:
    """The stream ends in exactly one terminal message, STOP or LENGTH, consistent with the
    request's stop ids and max_tokens; returns the generated ids."""
    assert messages, "an empty stream"
    terminal = [i for i, m in enumerate(messages) if m.finish_reason]
    assert terminal == [len(messages) - 1], [pb.FinishReason.Name(m.finish_reason) for m in messages]
    last = messages[-1]
    assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), (last.finish_reason, last.error)
    tokens = [t for m in messages for t in m.token_ids]
    if last.finish_reason == pb.FINISH_REASON_STOP:
        assert tokens and tokens[-1] in req.sampling.stop_token_ids and len(tokens) <= req.sampling.max_tokens
    else:
        assert len(tokens) == req.sampling.max_tokens
        assert not set(tokens[:-1]) & set(req.sampling.stop_token_ids)
    if req.request_id:
        assert all(m.request_id == req.request_id for m in messages)
    return tokens


def call(stub, req: pb.GenerateRequest) -> list[pb.GenerateResponse] | tuple[grpc.StatusCode, str]:
    """The whole stream, or the status (and its details) the call ended with."""
    try:
        return list(stub.Generate(req, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as e:
        return e.code(), e.details()


def expected_tokens(reference, req: pb.GenerateRequest) -> list[int]:
    s = req.sampling
    return engine.generate(reference, prompt_ids(req), s.max_tokens, s.temperature, s.top_p or 1.0, s.top_k,
                           s.seed, list(s.stop_token_ids))


@fuzz(60)
@given(req=generate_requests(valid_only=True), data=st.data())
def test_valid_requests_stream_token_exact(stub, reference, req, data):
    if data.draw(st.booleans(), label="stop at a token it generates"):  # random stop ids are rarely hit
        req.sampling.stop_token_ids.append(data.draw(st.sampled_from(expected_tokens(reference, req))))
    outcome = call(stub, req)
    if isinstance(outcome, tuple):
        assert outcome[0] in excusable(req), (outcome, req)
        return
    event(f"{'greedy' if req.sampling.temperature == 0 else 'sampled'} "
          f"{pb.FinishReason.Name(outcome[-1].finish_reason)} {req.WhichOneof('prompt')}")
    assert check_stream(outcome, req) == expected_tokens(reference, req)


@pytest.mark.parametrize("field,value,code", [
    ("deadline_s", 1e-9, grpc.StatusCode.DEADLINE_EXCEEDED), ("deadline_s", 1e-4, grpc.StatusCode.DEADLINE_EXCEEDED),
    ("ttft_slo_s", 1e-9, grpc.StatusCode.RESOURCE_EXHAUSTED), ("tbt_slo_s", 1e-4, grpc.StatusCode.RESOURCE_EXHAUSTED),
])
def test_valid_but_unmeetable_times_are_refused_as_excused(stub, field, value, code):
    """The statuses ``excusable`` allows besides a stream, for the reasons it gives."""
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams(max_tokens=4))
    setattr(req, field, value)
    assert not problems(req) and code in excusable(req)
    outcome = call(stub, req)
    assert isinstance(outcome, tuple) and outcome[0] == code, outcome


@fuzz(200)
@given(req=generate_requests(valid_only=False))
def test_any_request_streams_or_is_invalid_argument(stub, req):
    outcome, wrong = call(stub, req), problems(req)
    event(outcome[0].name if isinstance(outcome, tuple) else "stream")
    if wrong:
        assert isinstance(outcome, tuple) and outcome[0] == BAD, (wrong, outcome, req)
    elif isinstance(outcome, tuple):
        assert outcome[0] in excusable(req), (outcome, req)
    else:
        check_stream(outcome, req)


def test_a_long_multibyte_request_id_is_served_or_refused(stub):
    req = pb.GenerateRequest(request_id="\u00e9" * MAX_REQUEST_ID_LEN, token_ids=pb.TokenIds(ids=[1, 2, 3]),
                             sampling=pb.SamplingParams(max_tokens=2))
    outcome = call(stub, req)
    if isinstance(outcome, tuple):
        assert outcome[0] == BAD, outcome
    else:
        check_stream(outcome, req)


BASE_REQUEST = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), request_id="fuzz-base", tenant="fuzz",
                                  sampling=pb.SamplingParams(max_tokens=3, stop_token_ids=[9])).SerializeToString()
raw_messages = st.one_of(
    st.binary(max_size=300),
    st.builds(mutate, st.just(BASE_REQUEST), st.integers(0, 1000), st.binary(min_size=1, max_size=4),
              st.integers(0, 8)),
)


@fuzz(150)
@given(raw=raw_messages)
def test_raw_bytes_stream_or_invalid_argument(cluster, raw):
    try:
        req = pb.GenerateRequest.FromString(raw)
    except DecodeError:  # then the Conductor must refuse it too
        req = None
    # A damaged varint can make max_tokens any number up to 1024: valid, but too slow to fuzz.
    assume(req is None or req.sampling.max_tokens <= 16)
    ch = channel(cluster.endpoint)
    try:
        out = list(ch.unary_stream("/tidekv.v1.Inference/Generate")(raw, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as e:
        event(f"{e.code().name} ({'unparsable' if req is None else 'parsed'})")
        assert e.code() == BAD or (req is not None and not problems(req) and e.code() in excusable(req)), (
            e.code(), e.details(), raw)
        return
    finally:
        ch.close()
    event("stream")
    assert req is not None and not problems(req), (raw, req)
    check_stream([pb.GenerateResponse.FromString(m) for m in out], req)


def test_cluster_still_serves_after_the_fuzz(cluster, stub, reference):
    """Runs after the fuzz tests above (file order): every process is alive and serves exactly."""
    for name, proc in cluster.procs.items():
        assert proc.poll() is None, f"{name} exited with {proc.returncode}"
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(40, 11)), sampling=pb.SamplingParams(max_tokens=6))
    outcome = call(stub, req)
    assert not isinstance(outcome, tuple), outcome
    assert check_stream(outcome, req) == engine.generate(reference, prompt(40, 11), 6)
    for log in sorted((cluster.data_dir / "logs").glob("*.log")):
        text = log.read_text()
        assert "Traceback" not in text, f"{log.name}:\n{text[text.index('Traceback') - 2000:][:6000]}"
