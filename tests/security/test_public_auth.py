"""The public endpoint of a real cluster with API keys (gRPC and the OpenAI HTTP front):
the tenant, and so the cache salt, comes from the key; keys reload without a restart; a
tenant can probe only its own cache; and requests that are too big or malformed are
refused before any work, leaving the cluster serving."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

import engine
from conductor.apikeys import add_key
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from proto import inference_pb2 as pb
from runtime.grpc_server import channel
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt

UNAUTH, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
LONG_STREAM = 600  # tokens: a stream that is still live while the checks run (seconds on this model)
LONG_HTTP = 1024  # tokens: the Conductor's max_new_tokens, for the HTTP check's slow request (its checks take longer)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """(cluster, keys file, {name: key}): tenants acme (may also use acme-eu) and globex."""
    keys_file = tmp_path_factory.mktemp("keys") / "keys.json"
    keys = {"acme": add_key(str(keys_file), "acme", sub_tenants=["acme-eu"]),
            "globex": add_key(str(keys_file), "globex")}
    config = ClusterConfig(num_prefill=1, num_decode=1, policy="cache_aware", prefill_args=WORKER_ARGS,
                           decode_args=DECODE_ARGS, api_keys=str(keys_file), http_port=0)
    with LocalCluster(config) as c:
        yield c, keys_file, keys


@pytest.fixture(scope="module")
def reference():
    return engine.load_model("tiny")


def generate(cluster, key: str, ids, tenant: str = "", max_tokens: int = 4):
    client = Client(cluster.endpoint, api_key=key)
    try:
        return client.generate(Client.request(ids, max_tokens=max_tokens, tenant=tenant))
    finally:
        client.close()


def status_of(cluster, key: str, ids, tenant: str = "") -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster, key, ids, tenant)
    return e.value.code()


def test_a_key_is_needed_and_binds_the_tenant(keyed, reference):
    cluster, _, keys = keyed
    ids = prompt(40, 1)
    assert status_of(cluster, "", ids) == UNAUTH
    assert status_of(cluster, "tk-not-a-key", ids) == UNAUTH
    assert status_of(cluster, keys["acme"], ids, tenant="globex") == DENIED
    for tenant in ("", "acme", "acme-eu"):
        out = generate(cluster, keys["acme"], ids, tenant)
        assert out.finish_reason == "length" and out.token_ids == engine.generate(reference, ids, 4)
    conductor_log = (cluster.data_dir / "logs" / "conductor.log").read_text()
    assert "refused Generate from" in conductor_log and "unknown or revoked API key" in conductor_log


def test_a_tenant_probes_only_its_own_cache(keyed):
    """cached_tokens (and with it the time to first token) says whether a prompt is cached: a
    tenant sees only its own prefixes, whatever tenant field it sends."""
    cluster, _, keys = keyed
    ids = prompt(400, 2)
    assert generate(cluster, keys["acme"], ids).cached_tokens == 0
    assert generate(cluster, keys["acme"], ids).cached_tokens > 0
    assert generate(cluster, keys["globex"], ids).cached_tokens == 0
    assert generate(cluster, keys["acme"], ids, tenant="acme-eu").cached_tokens == 0
    assert status_of(cluster, keys["globex"], ids, tenant="acme") == DENIED


def test_keys_reload_without_a_restart(keyed):
    cluster, keys_file, _ = keyed
    pid = cluster.procs["conductor"].pid
    new = add_key(str(keys_file), "initech")
    ids = prompt(20, 3)
    until = time.monotonic() + 15
    while True:  # the file is checked at most once a second
        try:
            assert generate(cluster, new, ids).finish_reason == "length"
            break
        except grpc.RpcError as e:
            assert e.code() == UNAUTH and time.monotonic() < until, e
            time.sleep(0.2)
    doc = json.loads(keys_file.read_text())
    doc["keys"] = [k for k in doc["keys"] if k["tenant"] != "initech"]
    keys_file.write_text(json.dumps(doc))
    until = time.monotonic() + 15
    while True:
        try:
            generate(cluster, new, ids)
        except grpc.RpcError as e:
            assert e.code() == UNAUTH
            break
        assert time.monotonic() < until, "a revoked key still works"
        time.sleep(0.2)
    assert cluster.procs["conductor"].pid == pid and cluster.procs["conductor"].poll() is None


def test_the_http_front_forwards_the_key(keyed):
    cluster, _, keys = keyed
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 3}).encode()

    def post(headers: dict[str, str]) -> tuple[int, dict]:
        req = urllib.request.Request(f"{cluster.http_url}/completions", body,
                                     {"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    code, doc = post({})
    assert code == 401 and doc["error"]["type"] == "authentication_error", doc
    code, doc = post({"Authorization": "Bearer " + keys["globex"]})
    assert code == 200 and doc["usage"]["completion_tokens"] == 3, doc


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_oversized_and_malformed_requests_are_refused_before_work(keyed, reference):
    cluster, _, keys = keyed
    pid = cluster.procs["conductor"].pid
    before = peak_rss_bytes(pid)
    huge = pb.GenerateRequest(text="x" * (60 << 20), sampling=pb.SamplingParams(max_tokens=1))
    client = Client(cluster.endpoint, api_key=keys["acme"])
    with pytest.raises(grpc.RpcError) as e:
        list(client.stub.Generate(huge, timeout=60))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    grown = peak_rss_bytes(pid) - before
    assert grown < 20 << 20, f"the Conductor's peak memory grew by {grown >> 20} MiB for a refused 60 MB prompt"
    big = pb.GenerateRequest(text="y" * (2 << 20), sampling=pb.SamplingParams(max_tokens=1))
    with pytest.raises(grpc.RpcError) as e:
        list(client.stub.Generate(big, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_prompt_bytes" in e.value.details()
    raw = channel(cluster.endpoint).unary_stream("/tidekv.v1.Inference/Generate")
    auth = (("authorization", f"Bearer {keys['acme']}"),)
    not_utf8 = b"\x12\x02\xc3\x28" + pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=1)).SerializeToString()
    for garbage in (b"\xff\xff\xff\xff", not_utf8):
        with pytest.raises(grpc.RpcError) as e:
            list(raw(garbage, metadata=auth, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (garbage, e.value)
    ids = prompt(30, 4)
    out = generate(cluster, keys["acme"], ids)
    assert out.finish_reason == "length" and out.token_ids == engine.generate(reference, ids, 4)
    client.close()


def test_request_ids_are_scoped_to_their_tenant(keyed, reference):
    """Finding 2: while one tenant streams ``req-1``, another's ``req-1`` (on the same decode
    worker: there is one) finishes token-exact; a second live ``req-1`` of the same tenant is
    ALREADY_EXISTS, naming only that id; over HTTP the same with ``X-Request-Id`` (409)."""
    import threading

    cluster, _, keys = keyed
    long_ids, short_ids = prompt(40, 7100), prompt(40, 7101)
    streaming, done = threading.Event(), threading.Event()
    out_long: list = []

    def long_stream() -> None:
        client = Client(cluster.endpoint, api_key=keys["globex"])
        try:
            req = Client.request(long_ids, max_tokens=LONG_STREAM, request_id="req-1")
            tokens = []
            for msg in client.stub.Generate(req, timeout=120):
                tokens += msg.token_ids
                streaming.set()
                if msg.finish_reason:
                    out_long.append(tokens)
        finally:
            client.close()
            done.set()

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert streaming.wait(60)
    client = Client(cluster.endpoint, api_key=keys["acme"])
    try:
        other = client.generate(Client.request(short_ids, max_tokens=4, request_id="req-1"))
        assert other.finish_reason == "length" and other.token_ids == engine.generate(reference, short_ids, 4)
        assert other.request_id == "req-1"
        g = Client(cluster.endpoint, api_key=keys["globex"])  # the same tenant again, while its req-1 streams
        try:
            with pytest.raises(grpc.RpcError) as e:
                g.generate(Client.request(short_ids, max_tokens=4, request_id="req-1"))
        finally:
            g.close()
        assert not done.is_set(), "the long stream ended before the checks: raise LONG_STREAM"
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "'req-1'" in e.value.details() and "acme" not in e.value.details()
    finally:
        client.close()
    thread.join(120)
    assert out_long and out_long[0] == engine.generate(reference, long_ids, LONG_STREAM)

    def post(key: str, max_tokens: int) -> tuple[int, dict]:
        # Greedy and past EOS: the slow request runs its whole max_tokens (sampled, it could draw
        # EOS early and end before the checks)
        body = json.dumps({"model": "tiny", "prompt": "order", "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{cluster.http_url}/completions", body, {
            "Content-Type": "application/json", "Authorization": "Bearer " + key, "X-Request-Id": "order-1"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    results: dict[str, tuple[int, dict]] = {}
    slow = threading.Thread(target=lambda: results.update(slow=post(keys["globex"], LONG_HTTP)))
    slow.start()
    time.sleep(0.5)
    results["other_tenant"] = post(keys["acme"], 3)
    results["same_tenant"] = post(keys["globex"], 3)
    assert slow.is_alive(), "the slow request ended before the checks: raise LONG_HTTP"
    slow.join(120)
    assert results["other_tenant"][0] == 200 and results["slow"][0] == 200, results
    assert results["slow"][1]["usage"]["completion_tokens"] == LONG_HTTP
    assert results["same_tenant"][0] == 409, results["same_tenant"]
    assert results["same_tenant"][1]["error"]["code"] == "request_id_in_use"
