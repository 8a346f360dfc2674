"""A cluster whose every gRPC port serves TLS (certificates from `runtime.certs`, as
`tidekv certs` makes them): workers register and are driven over TLS, clients that verify the
CA are served token-exact, the HTTP front dials the Conductor over TLS, and a plaintext client
gets nothing."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
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
    body = json.dumps({"model": "tiny", "prompt": "over tls", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{c.http_url}/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2


def test_a_plaintext_client_is_not_served(tls_cluster):
    plain = Client(tls_cluster.endpoint)
    with pytest.raises(grpc.RpcError) as e:
        plain.generate(Client.request([1, 2, 3], max_tokens=1), timeout_s=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    plain.close()
