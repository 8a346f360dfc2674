"""Refusals through the HTTP front, in OpenAI's error shape: every bad field a 400 naming it
(checked by the front or by the Conductor, renamed), 404 for an unknown model or route, 429
with Retry-After under a flood, 503 without a reachable Conductor."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from deploy.local import free_port
from tests.e2e.helpers import wait_all_freed
from tests.openai_api.conftest import MODEL, HttpFront, make_cluster

BASE = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
DROP = object()


def body(base: dict, field: str, value: object) -> dict:
    out = dict(base)
    if value is DROP:
        out.pop(field, None)
    else:
        out[field] = value
    return out


# (endpoint body, field, bad value, the param named in the answer)
BAD = [
    (BASE, "max_tokens", 0, "max_tokens"),
    (BASE, "max_tokens", 10**9, "max_tokens"),
    (BASE, "max_tokens", 5000, "max_tokens"),        # within the context; over the Conductor's cap
    (BASE, "max_tokens", "16", "max_tokens"),
    (BASE, "temperature", -1, "temperature"),        # the Conductor's range check, renamed
    (BASE, "temperature", "hot", "temperature"),
    (BASE, "top_p", 2, "top_p"),
    (BASE, "top_p", 0, "top_p"),
    (BASE, "top_k", -2, "top_k"),
    (BASE, "top_k", 100_000, "top_k"),               # over the vocabulary: the Conductor's check
    (BASE, "seed", -1, "seed"),
    (BASE, "seed", 1.5, "seed"),
    (BASE, "n", 2, "n"),
    (BASE, "stop", 5, "stop"),
    (BASE, "stop", [""], "stop"),
    (BASE, "stop_token_ids", [-1], "stop_token_ids"),
    (BASE, "stop_token_ids", [99_999], "stop_token_ids"),
    (BASE, "stream", "yes", "stream"),
    (BASE, "stream_options", {"include_usage": True}, "stream_options"),  # without stream
    (BASE, "model", DROP, "model"),
    (BASE, "model", 5, "model"),
    (BASE, "prompt", DROP, "prompt"),
    (BASE, "prompt", 5, "prompt"),
    (BASE, "prompt", [], "prompt"),
    (BASE, "prompt", ["one", "two"], "prompt"),      # n-prompt batching is not offered
    (BASE, "prompt", [1, 99_999], "prompt"),         # outside the vocabulary: the Conductor's check
    (BASE, "prompt", "a" * 9000, "prompt"),          # longer than the Conductor's prompt limit
    (BASE, "logprobs", 1, "logprobs"),
    (BASE, "echo", True, "echo"),
    (BASE, "best_of", 2, "best_of"),
    (BASE, "presence_penalty", 0.5, "presence_penalty"),
    (BASE, "user", 5, "user"),
    (CHAT, "messages", DROP, "messages"),
    (CHAT, "messages", [], "messages"),
    (CHAT, "messages", "hi", "messages"),
    (CHAT, "messages", [{"role": "wizard", "content": "hi"}], "messages[0].role"),
    (CHAT, "messages", [{"role": "user", "content": 5}], "messages[0].content"),
    (CHAT, "messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content"),
    (CHAT, "max_completion_tokens", 0, "max_completion_tokens"),
    (CHAT, "max_completion_tokens", 5000, "max_completion_tokens"),
]


@pytest.fixture(scope="module")
def http(front):
    with httpx.Client(base_url=front.base_url, timeout=60) as h:
        yield h


@pytest.mark.parametrize("base,field,value,param", BAD,
                         ids=[f"{p}={v!r}"[:40] for _, _, v, p in BAD])
def test_bad_field_is_400_naming_it(http, base, field, value, param):
    path = "/v1/chat/completions" if "messages" in base else "/v1/completions"
    r = http.post(path, json=body(base, field, value))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and param in err["message"], err


def test_not_json_unknown_model_unknown_route(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json=body(BASE, "model", "gpt-4"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.get("/v1/embeddings")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert http.get("/v1/completions").status_code == 405


def test_flood_gets_429_with_retry_after():
    """One running slot, no queue: while one stream holds the slot, every other request is
    refused at once with 429 and a Retry-After (the Conductor's retry hint)."""
    with make_cluster(conductor_args=("--max-running", "1", "--max-queued", "0")) as cluster:
        front = HttpFront(cluster.endpoint).wait_up()
        client = openai.OpenAI(base_url=front.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            held = client.completions.create(model=MODEL, prompt="hold the slot", max_tokens=500, stream=True)
            next(iter(held))  # admitted and streaming

            def one(i: int) -> openai.RateLimitError | None:
                try:
                    client.completions.create(model=MODEL, prompt=f"flood {i}", max_tokens=4)
                except openai.RateLimitError as e:
                    return e
                return None

            with ThreadPoolExecutor(4) as pool:
                refusals = list(pool.map(one, range(8)))
            assert all(e is not None for e in refusals)
            for e in refusals:
                assert e.status_code == 429 and int(e.response.headers["retry-after"]) >= 1
                assert e.response.json()["error"]["code"] == "rate_limit_exceeded"
            held.close()  # the client goes away: the request is cancelled and the slot freed
            stats = wait_all_freed(cluster)
            assert all(s.num_live_requests == 0 for s in stats.values()), stats
        finally:
            client.close()
            front.stop()


def test_unreachable_conductor_is_503():
    front = HttpFront(f"127.0.0.1:{free_port()}").wait_up()
    try:
        assert httpx.get(front.base_url + "/health").status_code == 200  # the process is up
        r = httpx.get(front.base_url + "/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "conductor_unavailable"
        r = httpx.post(front.base_url + "/v1/completions", json=BASE, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    finally:
        front.stop()
