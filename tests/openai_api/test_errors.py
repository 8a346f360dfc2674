"""The gRPC status -> HTTP error mapping and field renaming (no processes)."""

import grpc
import pytest

from openai_api.errors import from_rpc, rename_field, retry_after_s

NAMES = {"max_tokens": "max_completion_tokens", "token_ids": "messages", "temperature": "temperature"}


@pytest.mark.parametrize("code,status,kind", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    (grpc.StatusCode.INTERNAL, 500, "server_error"),
])
def test_status_mapping(code, status, kind):
    e = from_rpc(code, "why", (), NAMES)
    assert (e.status, e.type) == (status, kind)
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_retry_after_from_trailing_metadata():
    e = from_rpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", (("retry-after-s", "2.5"),), NAMES)
    assert e.headers == {"Retry-After": "3"}
    assert retry_after_s(()) == 1 and retry_after_s((("retry-after-s", "0.1"),)) == 1


def test_no_workers_is_unavailable_not_rate_limited():
    # The Conductor answers UNAVAILABLE (not RESOURCE_EXHAUSTED) while a role has no worker.
    e = from_rpc(grpc.StatusCode.UNAVAILABLE, "no workers registered yet", (("retry-after-s", "5"),), NAMES)
    assert e.status == 503 and e.headers == {"Retry-After": "5"}


def test_invalid_argument_names_the_openai_field():
    e = from_rpc(grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens must be in [1, 1000], got 0", (), NAMES)
    assert e.message == "max_completion_tokens must be in [1, 1000], got 0" and e.param == "max_completion_tokens"
    assert rename_field("token_ids: prompt has 9000 tokens, the limit is 8000", NAMES) == (
        "messages: prompt has 9000 tokens, the limit is 8000", "messages")
    assert rename_field("deadline_s must be in [0, 3600]", NAMES) == ("deadline_s must be in [0, 3600]", None)


def test_a_message_over_the_conductors_size_limit_is_413_not_429():
    e = from_rpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9000000 vs. 8388608)", (), {})
    assert e.status == 413 and e.body()["error"]["code"] == "request_too_large"
    e = from_rpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "admission queue full", (("retry-after-s", "2"),), {})
    assert e.status == 429 and e.headers["Retry-After"] == "2"
