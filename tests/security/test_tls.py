"""A cluster whose every gRPC port serves TLS (certificates from `runtime.certs`, as
`tidekv certs` makes them): workers register and are driven over TLS, clients that verify the
CA are served token-exact, the HTTP front dials the Conductor over TLS and serves HTTPS (its
/metrics too), the workers' /metrics serve HTTPS, and a plaintext client gets nothing."""

from __future__ import annotations

import json
import ssl
import urllib.request

import grpc
import pytest

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from observe import top
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt


@pytest.fixture(scope="module")
def tls_cluster():
    config = ClusterConfig(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS,
                           tls=True, http_port=0)
    with LocalCluster(config) as c:
        yield c


def test_everything_runs_over_tls(tls_cluster):
    c = tls_cluster
    assert {w.worker_id for w in c.workers().workers} == {"prefill-0", "decode-0"}  # registered over TLS
    model = engine.load_model("tiny")
    client = Client(c.endpoint, tls_ca=c.tls.ca)
    for i in range(2):
        ids = prompt(80, 10 + i)
        out = client.generate(Client.request(ids, max_tokens=5))
        assert out.finish_reason == "length" and out.token_ids == engine.generate(model, ids, 5)
    client.close()
    assert c.http_url.startswith("https://")
    verified = ssl.create_default_context(cafile=c.tls.ca)
    ids = prompt(30, 12)
    body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{c.http_url}/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60, context=verified) as r:
        assert r.status == 200 and json.loads(r.read())["choices"][0]["token_ids"] == engine.generate(model, ids, 4)
    front = c.http_url.removesuffix("/v1").removeprefix("https://")
    workers = [w.metrics_address for w in c.workers().workers]
    for address in (front, *workers):
        samples = top.scrape(address, tls_ca=c.tls.ca)
        assert any(name.startswith("tidekv:") for name, _, _ in samples), address


def test_a_plaintext_client_is_not_served(tls_cluster):
    plain = Client(tls_cluster.endpoint)
    with pytest.raises(grpc.RpcError) as e:
        plain.generate(Client.request([1, 2, 3], max_tokens=1), timeout_s=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    plain.close()
    front = tls_cluster.http_url.removesuffix("/v1").removeprefix("https://")
    with pytest.raises(OSError):  # plain HTTP to an HTTPS port: no answer
        urllib.request.urlopen(f"http://{front}/health", timeout=10)
    for w in tls_cluster.workers().workers:
        assert top.scrape(w.metrics_address) == []  # plain HTTP: nothing
        with pytest.raises(OSError):  # HTTPS without the CA: the certificate is not trusted
            urllib.request.urlopen(f"https://{w.metrics_address}/metrics", timeout=10)
