"""The public client's failover (``conductor.client``) against a scripted Conductor on
loopback: a stream cut before its end resumes after the tokens received, and one cut after
its terminal message is over (one terminal message, no second call)."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from conductor.client import Client
from proto import inference_pb2 as pb
from proto import inference_pb2_grpc as pgrpc


class ScriptedConductor(pgrpc.InferenceServicer):
    """Call ``n`` sends ``scripts[n]``'s tokens (a list per message; ``None``: the terminal
    message), then, if ``cut[n]``, ends the call as a dying server's would (UNAVAILABLE)."""

    def __init__(self, scripts: list[list[list[int] | None]], cut: list[bool]):
        self.scripts, self.cut = scripts, cut
        self.requests: list[pb.GenerateRequest] = []

    def Generate(self, request, context):
        n = len(self.requests)
        self.requests.append(request)
        for tokens in self.scripts[n]:
            if tokens is None:
                yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH)
            else:
                yield pb.GenerateResponse(token_ids=tokens)
        if self.cut[n]:
            context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)")


@pytest.fixture
def serve():
    servers = []

    def start(servicer: ScriptedConductor) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        pgrpc.add_InferenceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def test_a_stream_cut_before_its_end_resumes_after_the_tokens_received(serve) -> None:
    conductor = ScriptedConductor([[[1, 2], [3]], [[4], None]], cut=[True, False])
    client = Client(serve(conductor))
    try:
        out = client.generate(Client.request([7, 8, 9], max_tokens=4))
    finally:
        client.close()
    assert (out.token_ids, out.finish_reason, out.num_terminal) == ([1, 2, 3, 4], "length", 1)
    assert len(conductor.requests) == 2
    assert list(conductor.requests[1].resume.ids) == [1, 2, 3] and conductor.requests[1].failover


def test_a_stream_cut_after_its_terminal_message_is_over(serve) -> None:
    """The Conductor died between its last message and the call's status: resuming would ask
    another replica for a request already finished (a second terminal message)."""
    conductor = ScriptedConductor([[[1, 2], None], [None]], cut=[True, False])
    client = Client(serve(conductor))
    try:
        out = client.generate(Client.request([7, 8, 9], max_tokens=2))
    finally:
        client.close()
    assert (out.token_ids, out.finish_reason, out.num_terminal) == ([1, 2], "length", 1)
    assert len(conductor.requests) == 1 and client.num_failovers == 0
