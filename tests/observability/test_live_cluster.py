"""A real Prometheus scrapes a live local cluster (Conductor, prefill and decode processes,
each serving /metrics on the port it is given) while a bounded workload runs: cached requests,
a rejection, a cancelled stream, and requests through the HTTP front (its own /metrics on its
port). Then every panel query and recording rule must answer with a finite sample and the
counters must agree with what the clients saw.

The servers serve /metrics once the lead wires ``runtime.metrics.start_metrics`` into them;
until then the Conductor opens no metrics port and the test skips, saying so."""

from __future__ import annotations

import shutil
import time
import urllib.request

import grpc
import httpx
import pytest

from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster, free_port
from observe.prometheus import RULES_PATH, LocalPrometheus, scrape_config
from tests.observability import promql
from tests.observability.workload import prompt

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus not installed (apt-get install -y prometheus)")
ARGS = ("--block-size", "16", "--num-pages", "512")


def _serves_metrics(address: str, timeout_s: float) -> bool:
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        try:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            time.sleep(0.5)
    return False


@pytest.fixture(scope="module")
def live():
    ports = {role: free_port() for role in ("conductor", "prefill", "decode")}
    config = ClusterConfig(
        conductor_args=("--metrics-port", str(ports["conductor"]), "--metrics-tenants", "acme"),
        prefill_args=(*ARGS, "--snapshot-interval-blocks", "2", "--metrics-port", str(ports["prefill"])),
        decode_args=(*ARGS, "--metrics-port", str(ports["decode"])), http_port=free_port())
    addresses = [f"127.0.0.1:{p}" for p in (*ports.values(), config.http_port)]
    with LocalCluster(config) as cluster:
        if not _serves_metrics(addresses[0], timeout_s=5):
            pytest.skip("metrics not wired into the servers yet (the Conductor serves no /metrics)")
        assert all(_serves_metrics(a, timeout_s=10) for a in addresses[1:]), "a worker serves no /metrics"
        with LocalPrometheus(scrape_config(addresses, interval_s=1.0, rule_files=[RULES_PATH])) as prom:
            assert promql.wait_for(prom.client, "count(up == 1)", 4.0, timeout_s=30) == 4.0, prom.log_tail()
            # Twice, a few scrapes apart: a labelled series appears with its first increment, and
            # rate() sees no increase in a series whose first sample already holds every one.
            first = _workload(cluster.endpoint, salt=0) | _http_workload(cluster.http_url, salt=0)
            time.sleep(3.0)
            second = _workload(cluster.endpoint, salt=100) | _http_workload(cluster.http_url, salt=100)
            seen = {k: first[k] + second[k] for k in first}
            promql.wait_until_all_pass(prom.client, promql.queries(), timeout_s=45)
            yield prom.client, seen, time.time()


def _workload(endpoint: str, salt: int) -> dict[str, int]:
    """Counts of what the clients saw: finished, cached tokens, first tokens, rejected, cancelled."""
    client = Client(endpoint)
    seen = {"finished": 0, "cached_tokens": 0, "first_tokens": 0, "rejected": 0, "cancelled": 0}
    try:
        base = prompt(64, 1 + salt)
        for i in range(6):
            done = client.generate(client.request(base + prompt(5 + i, 50 + i + salt), 4, tenant="acme"))
            assert done.finish_reason in ("length", "stop"), done
            seen["finished"] += 1
            seen["first_tokens"] += 1
            seen["cached_tokens"] += done.cached_tokens
        try:
            client.generate(client.request(prompt(40, 2 + salt), 4, ttft_slo_s=1e-6))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            seen["rejected"] += 1
        stream = client.stub.Generate(client.request(prompt(40, 3 + salt), 64), timeout=60)
        next(stream)  # the first token arrived; then the client goes away
        stream.cancel()
        seen["first_tokens"] += 1
        seen["cancelled"] += 1
    finally:
        client.close()
    return seen


def _http_workload(url: str, salt: int) -> dict[str, int]:
    """Through the front: a completion, a chat (prompts of their own: nothing cached), a model
    list, an unknown model, a bad body."""
    answers = [httpx.post(f"{url}/completions", json={"model": "tiny", "prompt": f"hello {salt}", "max_tokens": 3},
                          timeout=60),
               httpx.post(f"{url}/chat/completions", json={"model": "tiny", "max_tokens": 3,
                                                          "messages": [{"role": "user", "content": f"hi {salt}"}]},
                          timeout=60),
               httpx.get(f"{url}/models", timeout=60),
               httpx.post(f"{url}/completions", json={"model": "gpt-4", "prompt": "hi"}, timeout=60),
               httpx.post(f"{url}/completions", content=b"{not json", timeout=60)]
    assert [r.status_code for r in answers] == [200, 200, 200, 404, 400], [r.text for r in answers]
    return {"http_ok": 3, "http_errors": 2}


def test_every_panel_and_rule_answers_with_data(live) -> None:
    client, _, at_s = live
    bad = promql.wait_until_all_pass(client, promql.queries(), timeout_s=10, at_s=at_s)
    assert not bad, "queries without data:\n" + "\n".join(bad)


def test_counters_agree_with_what_the_clients_saw(live) -> None:
    client, seen, _ = live
    assert seen["cached_tokens"] > 0 and seen["rejected"] == 2
    checks = {'sum(tidekv:requests_total{outcome=~"stop|length"})': seen["finished"] + 2 * 2,
              'sum(tidekv:requests_total{outcome="rejected"})': seen["rejected"],
              'sum(tidekv:requests_total{outcome="cancelled"})': seen["cancelled"],
              "sum(tidekv:cached_prompt_tokens_total)": seen["cached_tokens"],
              "sum(tidekv:time_to_first_token_seconds_count)": seen["first_tokens"] + 2 * 2,
              'sum(tidekv:http_requests_total{status="200", route=~"/v1/.*"})': seen["http_ok"],
              'sum(tidekv:http_requests_total{status=~"4..", route=~"/v1/.*"})': seen["http_errors"]}
    for expr, want in checks.items():
        got = promql.wait_for(client, expr, float(want), timeout_s=20)
        assert got == want, f"{expr} = {got}, the clients saw {want}"
