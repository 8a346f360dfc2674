"""Body- and audience-bound signatures through a real gRPC server on loopback (in process):
the interceptor checks the bytes the server received, on unary and server-streaming methods,
and refuses what cannot be signed."""

from __future__ import annotations

import time

import grpc
import pytest

from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.auth import MAX_LEAD_S, OPERATOR, Member, Need, sign, worker_principal
from runtime.grpc_server import channel, start_server

SECRET = b"s" * 64
RESERVE, DECODE, UPLOAD = "/tidekv.v1.Decode/Reserve", "/tidekv.v1.Decode/Decode", "/test.Upload/Send"
ME = worker_principal("decode-0")


class Decode(igrpc.DecodeServicer):
    def Reserve(self, request, context):
        return ipb.ReserveResponse(transfer_address=f"got {request.request_id}")

    def Decode(self, request, context):
        for i in range(3):
            yield ipb.DecodeResponse(token_ids=[request.first_token + i])


def _upload(server: grpc.Server) -> None:
    handler = grpc.stream_unary_rpc_method_handler(lambda it, ctx: b"ok", request_deserializer=None,
                                                   response_serializer=None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Upload", {"Send": handler}),))


@pytest.fixture(scope="module")
def served():
    member = Member(SECRET, ME)
    t0 = time.time()
    interceptor = member.interceptor({RESERVE: Need.MEMBER, DECODE: Need.MEMBER, UPLOAD: Need.MEMBER},
                                     lambda p: None)
    assert time.time() - t0 >= MAX_LEAD_S * 0.99 and interceptor.floor_s <= time.time()
    running = start_server([lambda s: igrpc.add_DecodeServicer_to_server(Decode(), s), _upload],
                           ["tidekv.v1.Decode"], interceptors=[interceptor])
    yield running.address, interceptor
    running.stop(0)


def status(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def raw(address: str, method: str, body: bytes, metadata) -> bytes:
    """One call with exactly these bytes and metadata, as a relay would send it."""
    with channel(address) as ch:
        return ch.unary_unary(method)(body, metadata=metadata, timeout=5)


def test_signed_unary_and_streaming_calls_pass(served):
    address, _ = served
    ch = Member(SECRET, OPERATOR).channel(address, audience=ME)
    stub = igrpc.DecodeStub(ch)
    assert stub.Reserve(ipb.ReserveRequest(request_id="r1"), timeout=5).transfer_address == "got r1"
    assert [m.token_ids[0] for m in stub.Decode(ipb.DecodeRequest(first_token=7), timeout=5)] == [7, 8, 9]
    ch.close()


def test_an_edited_body_or_another_audience_is_refused(served):
    address, _ = served
    body = ipb.ReserveRequest(request_id="r1", max_tokens=5).SerializeToString()
    edited = ipb.ReserveRequest(request_id="r1", max_tokens=50_000).SerializeToString()
    md = sign(SECRET, OPERATOR, RESERVE, ME, body)
    code, details = status(lambda: raw(address, RESERVE, edited, md))
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("body:"), details
    assert raw(address, RESERVE, body, md) == ipb.ReserveResponse(transfer_address="got r1").SerializeToString()
    code, details = status(lambda: raw(address, RESERVE, body, md))
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("replay:"), details
    stream_body = ipb.DecodeRequest(first_token=1).SerializeToString()
    stream_md = sign(SECRET, OPERATOR, DECODE, ME, stream_body)
    with channel(address) as ch:
        call = ch.unary_stream(DECODE)(ipb.DecodeRequest(first_token=2).SerializeToString(), metadata=stream_md)
        code, details = status(lambda: list(call))
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("body:"), details
    other = igrpc.DecodeStub(Member(SECRET, OPERATOR).channel(address, audience=worker_principal("decode-1")))
    code, details = status(lambda: other.Reserve(ipb.ReserveRequest(request_id="r2"), timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("audience:"), details
    assert "'worker/decode-1'" in details and repr(ME) in details


def test_before_the_floor_malformed_and_client_streaming_calls_are_refused(served):
    address, interceptor = served
    body = ipb.ReserveRequest(request_id="old").SerializeToString()
    old = sign(SECRET, OPERATOR, RESERVE, ME, body, now_s=interceptor.floor_s - 0.5)
    code, details = status(lambda: raw(address, RESERVE, body, old))
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("floor:"), details
    junk = b"\xff\xff\xff"
    code, details = status(lambda: raw(address, RESERVE, junk, sign(SECRET, OPERATOR, RESERVE, ME, junk)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in details
    with channel(address) as ch:
        upload = ch.stream_unary(UPLOAD)
        code, details = status(lambda: upload(iter([b"a"]), metadata=sign(SECRET, OPERATOR, UPLOAD, ME, b"a"),
                                              timeout=5))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "client-streaming" in details
