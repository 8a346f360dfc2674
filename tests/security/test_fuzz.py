"""Fuzzing with hypothesis of everything that parses bytes from outside the process.

Three targets:

* the public ``Generate`` of a live 1P1D cluster: random requests (valid and invalid field
  values) and random or mutated raw messages end in a correct stream (one terminal message,
  STOP or LENGTH, token-exact with the single-process engine) or INVALID_ARGUMENT, never
  INTERNAL, UNKNOWN, UNAVAILABLE or a hang; an independent reading of the proto's field rules
  says which of the two each request must get;
* the transfer frame parser (``frames.unpack_header``) and the stream reader that drives it
  (``wire.FrameConnection``): random and damaged bytes raise ``FrameError`` or close the
  connection with a protocol error, and a declared body beyond ``max_frame_bytes`` is refused
  before its buffer is allocated;
* the block payload codec (``payload_format.decode``): random, damaged and CRC-consistent but
  nonsensical encodings raise ``PayloadError``, without allocating what a header claims.

Every run is derandomized (CI sees the same examples each time) and keeps no example database.
"""

from __future__ import annotations

import contextlib
import math
import struct
import tracemalloc
import zlib

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import engine
from deploy.local import ClusterConfig, LocalCluster
from kvstore import payload_format as codec
from kvstore.payload import make_random_payload
from kvstore.transfer.base import Frame, LinkClosed
from kvstore.transfer.frames import (
    FLAG_INLINE_BODY,
    FRAME_VERSION,
    HEADER_BYTES,
    MAGIC,
    DType,
    FrameError,
    FrameHeader,
    Kind,
    checksum,
    control_header,
    unpack_header,
)
from kvstore.transfer.wire import FrameConnection
from proto import inference_pb2 as pb
from proto import inference_pb2_grpc as pgrpc
from runtime.grpc_server import channel
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt


def fuzz(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- the public Generate of a live cluster -----------------------------------------------------

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


def _mutate(data: bytes, position: int, new: bytes, cut: int) -> bytes:
    """``data`` with ``new`` written over it at ``position`` (wrapped) and then ``cut`` bytes
    removed from the end."""
    if data:
        position %= len(data)
        data = data[:position] + new + data[position + len(new):]
    return data[:len(data) - cut] if cut < len(data) else b""


BASE_REQUEST = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), request_id="fuzz-base", tenant="fuzz",
                                  sampling=pb.SamplingParams(max_tokens=3, stop_token_ids=[9])).SerializeToString()
raw_messages = st.one_of(
    st.binary(max_size=300),
    st.builds(_mutate, st.just(BASE_REQUEST), st.integers(0, 1000), st.binary(min_size=1, max_size=4),
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


# ---- the transfer frame parser and the stream reader --------------------------------------------

REAL_HEADERS = (
    FrameHeader(Kind.MLA_ROWS, "req-1", seq=3, layer=2, token_start=16, token_end=32, dtype=DType.BFLOAT16,
                shape=(16, 64), body_bytes=16 * 64 * 2, body_checksum=0x1234, flags=FLAG_INLINE_BODY),
    FrameHeader(Kind.KDA_STATE, "\u00e9t\u00e9", seq=9, layer=1, dtype=DType.FLOAT32, shape=(2, 4, 4),
                body_bytes=128, aux=4096),
    control_header(Kind.ABORT, "req-2", seq=5, payload=b"gave up"),
)
# The documented layout (frames' module docstring), written out again so that the test builds
# headers with any field values, checksummed, independently of FrameHeader.pack.
HEADER_LAYOUT = (("magic", "4s"), ("version", "H"), ("kind", "B"), ("dtype", "B"), ("ndim", "B"), ("algo", "B"),
                 ("rid_len", "B"), ("flags", "B"), ("layer", "i"), ("seq", "Q"), ("token_start", "q"),
                 ("token_end", "q"), ("s0", "q"), ("s1", "q"), ("s2", "q"), ("s3", "q"), ("body_bytes", "Q"),
                 ("aux", "Q"), ("body_checksum", "I"), ("rid", "64s"))
LAYOUT = struct.Struct("<" + "".join(code for _, code in HEADER_LAYOUT))
assert LAYOUT.size + 4 == HEADER_BYTES


def _flip(data: bytes, position: int, xor: int) -> bytes:
    out = bytearray(data)
    out[position % len(out)] ^= xor
    return bytes(out)


@fuzz(300)
@given(raw=st.one_of(st.binary(max_size=2 * HEADER_BYTES), st.binary(min_size=HEADER_BYTES, max_size=HEADER_BYTES),
                     st.binary(min_size=HEADER_BYTES - 6, max_size=HEADER_BYTES - 6).map(
                         lambda rest: MAGIC + struct.pack("<H", FRAME_VERSION) + rest)))
def test_random_bytes_raise_frame_error(raw):
    with pytest.raises(FrameError):
        unpack_header(raw)


@fuzz(300)
@given(base=st.sampled_from(REAL_HEADERS), flips=st.lists(st.tuples(st.integers(0, HEADER_BYTES - 1),
                                                                    st.integers(1, 255)), max_size=4))
def test_damaged_headers_raise_frame_error(base, flips):
    raw = base.pack()
    for position, xor in flips:
        raw = _flip(raw, position, xor)
    if raw == base.pack():  # no flips, or flips that cancel out
        assert unpack_header(raw) == base
    else:
        with pytest.raises(FrameError):
            unpack_header(raw)


def _any(code: str) -> st.SearchStrategy[int]:
    """Any value of the struct integer ``code``."""
    bits = struct.calcsize("<" + code) * 8
    return st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if code.islower() else st.integers(0, (1 << bits) - 1)


@st.composite
def checksummed_headers(draw) -> bytes:
    """Headers with a correct header checksum and in-range field values, except (in most
    examples) one field set to anything its width holds: what a buggy or hostile peer, rather
    than line noise, sends."""
    ndim = draw(st.integers(0, 4))
    shape = draw(st.lists(st.one_of(st.integers(0, 64), _any("q")), min_size=4, max_size=4))
    dtype = draw(st.sampled_from(list(DType)))
    rid = draw(st.text(max_size=20).map(str.encode).filter(lambda b: len(b) <= 64))
    fields = {"magic": MAGIC, "version": FRAME_VERSION, "kind": int(draw(st.sampled_from(list(Kind)))),
              "dtype": int(dtype), "ndim": ndim, "algo": draw(st.integers(1, 2)), "rid_len": len(rid),
              "flags": draw(_any("B")), "layer": draw(_any("i")), "seq": draw(_any("Q")),
              "token_start": draw(_any("q")), "token_end": draw(_any("q")),
              **dict(zip(("s0", "s1", "s2", "s3"), shape, strict=True)),
              "body_bytes": math.prod(shape[:ndim]) * dtype.itemsize % (1 << 64), "aux": draw(_any("Q")),
              "body_checksum": draw(_any("I")), "rid": rid}
    damaged = draw(st.sampled_from((None, *HEADER_LAYOUT)))
    if damaged is not None:
        name, code = damaged
        fields[name] = draw(st.binary(min_size=4, max_size=4) if code == "4s" else
                            st.binary(max_size=64) if code == "64s" else _any(code))
    covered = LAYOUT.pack(*(fields[name] for name, _ in HEADER_LAYOUT))
    return covered + struct.pack("<I", zlib.crc32(covered))


@fuzz(400)
@given(raw=checksummed_headers())
def test_checksummed_headers_parse_or_raise_frame_error(raw):
    try:
        header = unpack_header(raw)
    except FrameError:
        return
    # Not byte-exact: bytes past request_id_len and shape[ndim:] are ignored, and packed as zeros.
    assert unpack_header(header.pack()) == header
    if header.kind.is_data:
        assert header.body_bytes == math.prod(header.shape) * header.dtype.itemsize


@pytest.mark.parametrize(("shape", "body_bytes"), [((-1, -1), 1), ((0, -5), 0), ((-2, -3), 6)])
def test_negative_shape_dims_raise_frame_error(shape, body_bytes):
    """Found by the fuzz: dims whose product matches body_bytes reached ``as_tensor``'s view."""
    raw = FrameHeader(Kind.BLOB, "req", shape=shape, body_bytes=body_bytes, flags=FLAG_INLINE_BODY).pack()
    with pytest.raises(FrameError):
        unpack_header(raw)


class FakeTransport:
    """The little of an asyncio transport that ``FrameConnection`` calls while reading."""

    def __init__(self):
        self.paused = self.aborted = False

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False

    def abort(self):
        self.aborted = True

    def is_closing(self):
        return self.aborted


def read_stream(data: bytes, chunk_bytes: list[int], max_frame_bytes: int = 1 << 20) -> list[Frame | LinkClosed]:
    """Feeds ``data`` to a ``FrameConnection`` as the event loop would (``get_buffer`` then
    ``buffer_updated``, ``chunk_bytes`` at a time, cycled; never while reading is paused) and
    returns what it delivered, inline bodies copied and released as a consumer does."""
    conn, transport = FrameConnection(max_frame_bytes), FakeTransport()
    conn.connection_made(transport)
    delivered: list[Frame | LinkClosed] = []
    position, turn = 0, 0
    while position < len(data) and not conn.closed.is_set():
        view = conn.get_buffer(-1)
        n = min(len(view), len(data) - position, max(1, chunk_bytes[turn % len(chunk_bytes)]))
        view[:n] = data[position:position + n]
        conn.buffer_updated(n)
        position, turn = position + n, turn + 1
        # The queue is private; reading it directly keeps the test synchronous (no event loop).
        while not conn._frames.empty():
            item = conn._frames.get_nowait()
            if isinstance(item, Frame) and item.inline is not None:
                item = Frame(item.header, memoryview(bytes(item.inline)))
                conn.release()
            delivered.append(item)
        assert not transport.paused or conn.closed.is_set(), "reading paused with nothing held"
    return delivered


def _frame_bytes(header: FrameHeader, body: bytes) -> bytes:
    return header._replace(body_checksum=checksum(header.checksum_algo, body)).pack() + body


STREAM = [(control_header(Kind.SYNC, "s", seq=1), b""),
          (FrameHeader(Kind.BLOB, "b", seq=2, shape=(40,), body_bytes=40, flags=FLAG_INLINE_BODY), bytes(range(40))),
          (control_header(Kind.ABORT, "a", seq=3, payload=b"why"), b"why"),
          (FrameHeader(Kind.MLA_ROWS, "m", seq=4, dtype=DType.FLOAT32, shape=(2, 3), body_bytes=24), b"")]
STREAM_BYTES = b"".join(_frame_bytes(h, b) for h, b in STREAM)
chunks = st.lists(st.integers(1, 400), min_size=1, max_size=5)


@fuzz(200)
@given(raw=st.binary(max_size=1000), chunk_bytes=chunks)
def test_stream_of_random_bytes_closes_with_protocol_error(raw, chunk_bytes):
    delivered = read_stream(raw, chunk_bytes)
    if len(raw) < HEADER_BYTES:
        assert delivered == []
    else:
        assert len(delivered) == 1 and isinstance(delivered[0], LinkClosed), delivered
        assert delivered[0].reason.startswith("protocol error"), delivered[0].reason


@fuzz(300)
@given(position=st.integers(0, len(STREAM_BYTES) - 1), xor=st.integers(1, 255), chunk_bytes=chunks)
def test_damaged_stream_delivers_good_frames_then_stops(position, xor, chunk_bytes):
    """A damaged header ends the connection right there; a damaged body is delivered as sent
    and fails its checksum (which the receiver verifies)."""
    delivered = read_stream(_flip(STREAM_BYTES, position, xor), chunk_bytes)
    starts = [0]
    for _, body in STREAM:
        starts.append(starts[-1] + HEADER_BYTES + len(body))
    hit = max(i for i, start in enumerate(starts[:-1]) if start <= position)
    in_header = position - starts[hit] < HEADER_BYTES
    frames = [d for d in delivered if isinstance(d, Frame)]
    good = [(h.describe(), b) for h, b in STREAM]
    got = [(f.header.describe(), bytes(f.inline or b"")) for f in frames]
    if in_header:
        assert got == good[:hit]
        assert isinstance(delivered[-1], LinkClosed) and delivered[-1].reason.startswith("protocol error")
    else:
        assert [g[0] for g in got] == [g[0] for g in good] and not any(isinstance(d, LinkClosed) for d in delivered)
        damaged = frames[hit]
        assert checksum(damaged.header.checksum_algo, damaged.inline) != damaged.header.body_checksum


@fuzz(50)
@given(body_bytes=st.integers((1 << 20) + 1, (1 << 63) - 1))
def test_oversized_body_is_refused_before_allocation(body_bytes):
    header = FrameHeader(Kind.BLOB, "big", shape=(body_bytes,), body_bytes=body_bytes, flags=FLAG_INLINE_BODY)
    tracemalloc.start()
    try:
        delivered = read_stream(header.pack() + b"x" * 100, [4096], max_frame_bytes=1 << 20)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(delivered) == 1 and "exceeds max_frame_bytes" in delivered[0].reason
    assert peak_bytes < 512 << 10, f"{peak_bytes} bytes allocated to refuse a {body_bytes}-byte body"


# ---- the block payload codec ---------------------------------------------------------------------

PAYLOADS = (
    make_random_payload(torch.Generator().manual_seed(1), block_size=4, latent_dim=8),
    make_random_payload(torch.Generator().manual_seed(2), mla_layer_ids=(0,), kda_layer_ids=(1, 2),
                        block_size=2, latent_dim=4, dtype=torch.bfloat16),
)
ENCODED = tuple(codec.encode(p) for p in PAYLOADS)
FIELDS = codec._FIXED_FIELDS  # the fixed header's field names in byte order
FIXED = codec._FIXED
HEADER_CRC_AT = codec._HEADER_CRC_OFFSET
MIB = 1 << 20


def decode_bounded(buf: bytes | bytearray, limit_bytes: int = 4 * MIB, verify_checksum: bool = True):
    """``codec.decode``, asserting it allocated at most ``limit_bytes`` beyond a copy of ``buf``
    (tensors are views of that copy, or of ``buf`` itself when it is writable)."""
    tracemalloc.start()
    try:
        return codec.decode(buf, verify_checksum=verify_checksum)
    finally:
        peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak_bytes < limit_bytes + len(buf), f"decoding {len(buf)} bytes allocated {peak_bytes}"


@fuzz(300)
@given(raw=st.one_of(st.binary(max_size=600), st.binary(max_size=600).map(lambda b: codec.MAGIC + b)))
def test_random_bytes_raise_payload_error(raw):
    with pytest.raises(codec.PayloadError):
        decode_bounded(raw)


@fuzz(300)
@given(which=st.sampled_from([0, 1]), position=st.integers(0, 10_000), new=st.binary(min_size=1, max_size=8),
       cut=st.integers(0, 300), extra=st.binary(max_size=3))
def test_damaged_payloads_raise_payload_error(which, position, new, cut, extra):
    raw = _mutate(ENCODED[which], position, new, cut) + extra
    if raw == ENCODED[which]:
        assert decode_bounded(raw).same_as(PAYLOADS[which])
    else:
        with pytest.raises(codec.PayloadError):
            decode_bounded(raw)


def _rewrite(encoded: bytes, changes: dict[str, int], fix_body_bytes: bool) -> bytearray:
    """``encoded`` with fixed header fields replaced and the header checksum recomputed (with
    ``fix_body_bytes``, body_bytes made to match the new shapes too)."""
    buf = bytearray(encoded)
    fields = dict(zip(FIELDS, FIXED.unpack_from(buf), strict=True)) | changes
    if fix_body_bytes:
        head = codec.PayloadHeader(**{k: v for k, v in fields.items() if k not in ("magic", "version")})
        with contextlib.suppress(codec.PayloadError):  # an unknown dtype: leave body_bytes
            fields["body_bytes"] = head.expected_body_bytes() % (1 << 64)
    FIXED.pack_into(buf, 0, *(fields[name] for name in FIELDS))
    header_bytes = min(fields["header_bytes"], len(buf))
    struct.pack_into("<I", buf, HEADER_CRC_AT, 0)
    struct.pack_into("<I", buf, HEADER_CRC_AT, zlib.crc32(buf[:header_bytes]))
    return buf


U16, U32 = st.integers(0, 0xFFFF), st.integers(0, 0xFFFF_FFFF)
SMALL_OR_U16 = st.one_of(st.integers(0, 4), U16)
FIELD_VALUES = {"flags": U16, "header_bytes": st.one_of(st.sampled_from([64, 128, 192]), U32),
                "body_bytes": st.integers(0, (1 << 64) - 1), "fingerprint_len": st.one_of(st.integers(0, 80), U16),
                "num_mla_layers": SMALL_OR_U16, "num_kda_layers": SMALL_OR_U16,
                **{name: st.integers(0, 255) for name in ("mla_dtype", "state_dtype", "conv_dtype")},
                **{name: st.one_of(st.integers(0, 16), U32) for name in
                   ("block_size", "latent_dim", "kda_heads", "kda_key_dim", "kda_value_dim", "conv_rows",
                    "conv_channels")}}


@fuzz(400)
@given(which=st.sampled_from([0, 1]), fix_body_bytes=st.booleans(), verify_checksum=st.booleans(),
       changes=st.lists(st.sampled_from(sorted(FIELD_VALUES)), unique=True, max_size=4).flatmap(
           lambda names: st.fixed_dictionaries({name: FIELD_VALUES[name] for name in names})))
def test_checksummed_nonsense_headers_raise_payload_error(which, fix_body_bytes, verify_checksum, changes):
    """Field values a buggy writer could produce, with a correct header checksum: refused with
    PayloadError and without allocating what the header claims, or decoded to a payload that
    round-trips."""
    buf = _rewrite(ENCODED[which], changes, fix_body_bytes)
    try:
        payload = decode_bounded(buf, limit_bytes=MIB, verify_checksum=verify_checksum)
    except codec.PayloadError:
        return
    # Not byte-exact: flag bits but the snapshot's, and header bytes past the layer ids, are ignored.
    assert codec.decode(codec.encode(payload)).same_as(payload)


def test_kda_layers_without_snapshot_raise_payload_error():
    with pytest.raises(codec.PayloadError):
        codec.decode(_rewrite(ENCODED[0], {"num_kda_layers": 1}, fix_body_bytes=False))


@pytest.mark.parametrize("verify_checksum", [True, False])
def test_a_huge_claimed_tensor_is_refused_without_allocating(verify_checksum):
    """A header claiming 8 TiB of MLA rows (shapes and body_bytes consistent, checksum right)."""
    buf = _rewrite(ENCODED[0], {"block_size": 1 << 20, "latent_dim": 1 << 20}, fix_body_bytes=True)
    assert codec.read_header(buf, complete=False).body_bytes == 2 * (1 << 40) * 4
    tracemalloc.start()
    try:
        with pytest.raises(codec.PayloadError, match="truncated"):
            codec.decode(bytes(buf), verify_checksum=verify_checksum)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_bytes < MIB, peak_bytes
