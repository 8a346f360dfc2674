"""A plain ``httpx`` SSE client, as a peer's benchmark client speaks to an OpenAI endpoint
(vLLM's and SGLang's benchmark clients do not install here without CUDA), and clients that
go away mid-request: their requests are cancelled and their pages freed on both workers."""

from __future__ import annotations

import json
import socket
import time
import uuid

import httpx

import engine
from tests.e2e.helpers import prompt, wait_all_freed, worker_stats
from tests.openai_api.conftest import MODEL

EOS = engine.load_tokenizer(MODEL).eos_token_id


def sse_events(response: httpx.Response):
    """The JSON payloads of ``data:`` lines, up to ``data: [DONE]`` (which must come)."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            assert line == "", line
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line[len("data: "):])
    raise AssertionError("stream ended without data: [DONE]")


def test_plain_httpx_sse_client(front, reference):
    ids = prompt(90, 11)
    req = {"model": MODEL, "prompt": ids, "max_tokens": 24, "temperature": 0.7, "seed": 5, "stream": True,
           "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.Client(timeout=60) as h, h.stream("POST", front.base_url + "/v1/completions", json=req) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    chunks, usage = events[:-1], events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
    got = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert got == engine.generate(reference, ids, 24, temperature=0.7, seed=5)  # ignore_eos: no EOS stop
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in events}) == 1 and all(c["usage"] is None for c in chunks)


def assert_freed_and_cancelled(cluster, front, request_id):
    stats = wait_all_freed(cluster)
    for name, s in stats.items():
        assert s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total, (name, s)
    # The request was cut short by a cancel of its gRPC call, not run to its 1000 tokens.
    assert f"request {request_id}: cancelled before its finish" in front.log_text()


def test_disconnect_mid_stream_frees_pages(cluster, front, reference):
    rid = f"sse-gone-{uuid.uuid4().hex[:8]}"
    req = {"model": MODEL, "prompt": prompt(120, 12), "max_tokens": 1000, "temperature": 0, "stream": True,
           "ignore_eos": True}
    url = front.base_url + "/v1/completions"
    with httpx.Client(timeout=60) as h, h.stream("POST", url, json=req, headers={"X-Request-Id": rid}) as r:
        assert r.headers["x-request-id"] == rid
        for n, _ in enumerate(sse_events(r), 1):
            if n >= 5:
                break  # leaving the block closes the connection mid-stream
    assert_freed_and_cancelled(cluster, front, rid)
    # The cluster serves correctly afterwards.
    ids = prompt(40, 13)
    r = httpx.post(front.base_url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 6,
                                                             "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.json()["choices"][0]["token_ids"] == engine.generate(reference, ids, 6)


def test_disconnect_while_waiting_for_whole_response_frees_pages(cluster, front):
    rid = f"json-gone-{uuid.uuid4().hex[:8]}"
    payload = json.dumps({"model": MODEL, "prompt": prompt(100, 14), "max_tokens": 1000, "temperature": 0,
                          "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {rid}\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", front.port), timeout=30)
    try:
        sock.sendall(head + payload)
        until = time.monotonic() + 60
        while not any(s.num_live_requests for s in worker_stats(cluster).values()):  # until it is being served
            assert time.monotonic() < until, "the request never reached the workers"
            time.sleep(0.05)
    finally:
        sock.close()  # gone before the answer
    assert_freed_and_cancelled(cluster, front, rid)
