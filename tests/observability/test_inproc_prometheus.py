"""A real Prometheus scrapes the metrics of the instrumented Conductor, prefill and decode
code running in this process (``inproc.InProcCluster``, served by ``runtime.metrics``) while
a bounded workload runs; then every panel query and every recording rule must answer with a
finite sample, every metric a panel names must exist, the counters must agree with what the
client saw, and the tenant label must stay bounded. Needs the Debian ``prometheus`` package."""

from __future__ import annotations

import argparse
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

import matplotlib.image
import pytest
from prometheus_client import CollectorRegistry

from conductor.config import ConductorConfig
from observe import snapshots, top
from observe.grafana import panels_of
from observe.prometheus import RULES_PATH, LocalPrometheus, PrometheusClient, scrape_config
from runtime.metrics import DEFAULT_TENANT, OTHER_TENANT, Identity, disable, enable, start_metrics
from tests.observability import promql
from tests.observability.inproc import PREFILL, InProcCluster, Seen
from tests.observability.workload import (
    ALLOWED_TENANTS,
    NUM_DISTINCT_TENANTS,
    FrontLoad,
    faulty_transfers,
    run_requests,
)

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus not installed (apt-get install -y prometheus)")


@dataclass
class Scraped:
    client: PrometheusClient
    seen: list[Seen]
    metrics_address: str  # the test process's /metrics (every component's series)
    at_s: float | None  # when every query first answered: later checks evaluate at this moment


@pytest.fixture(scope="module")
def scraped():
    """A Prometheus that scraped the in-process cluster during the workload."""
    registry = CollectorRegistry()
    enable(Identity(PREFILL, "prefill", "tiny"), registry)  # the transfer engine's process context
    cluster = InProcCluster(registry, ConductorConfig(policy="mooncake", metrics_tenants=ALLOWED_TENANTS))
    server = start_metrics("127.0.0.1", 0, registry=registry)
    front = FrontLoad(registry)
    prom = LocalPrometheus(scrape_config([server.address], interval_s=1.0, rule_files=[RULES_PATH]))
    try:
        prom.wait_ready(timeout_s=60)
        # Rates need samples from before the workload: wait for the first scrapes.
        assert promql.wait_for(prom.client, "count(up == 1)", 1.0, timeout_s=30) == 1.0, prom.log_tail()
        front.round()
        time.sleep(2.0)
        seen = run_requests(cluster)
        faulty_transfers(cluster)
        statuses = front.round()
        assert statuses == {200: 2, 400: 1, 404: 2, 503: 2}, statuses
        promql.wait_until_all_pass(prom.client, promql.queries(), timeout_s=45)
        yield Scraped(prom.client, seen, server.address, time.time())
    finally:
        prom.stop()
        front.close()
        server.stop()
        cluster.close()
        disable()


def test_every_panel_and_rule_answers_with_data(scraped) -> None:
    client = scraped.client
    checks = promql.queries()
    assert len(checks) > 60
    bad = promql.wait_until_all_pass(client, checks, timeout_s=10, at_s=scraped.at_s)
    assert not bad, "queries without data:\n" + "\n".join(bad)


def test_every_metric_a_panel_names_exists(scraped) -> None:
    client = scraped.client
    promql.wait_until_all_pass(client, [("rule", r["expr"]) for r in promql.rules()], timeout_s=30)
    recorded = {r["record"] for r in promql.rules()}
    known = client.metric_names()
    used = set().union(*(promql.metric_names(expr) for _, expr in promql.queries()))
    missing = sorted(n for n in used if n not in known)
    assert not missing, f"panels or rules name metrics Prometheus never saw: {missing}"
    assert {n for n in used if n.count(":") == 2} <= recorded  # two colons: a recording rule of ours


def test_counters_agree_with_what_the_client_saw(scraped) -> None:
    client, seen = scraped.client, scraped.seen
    outcomes = Counter(s.outcome for s in seen)
    assert outcomes["cancelled"] == 1 and outcomes["failed"] == 1 and outcomes["invalid"] == 1
    assert outcomes["rejected"] == 2 and outcomes["length"] == len(seen) - 5
    for outcome, n in outcomes.items():
        got = promql.wait_for(client, f'sum(tidekv:requests_total{{outcome="{outcome}"}})', float(n), timeout_s=20)
        assert got == n, f"requests_total{{outcome={outcome}}} = {got}, the client saw {n}"
    cached = sum(s.cached_tokens for s in seen if s.first_token)
    assert cached > 0
    assert promql.wait_for(client, "sum(tidekv:cached_prompt_tokens_total)", float(cached), 20) == cached
    firsts = sum(s.first_token for s in seen)
    assert promql.wait_for(client, "sum(tidekv:time_to_first_token_seconds_count)", float(firsts), 20) == firsts
    # Every request that got past admission and routing has exactly one terminal message.
    assert all(len(s.terminals) == 1 for s in seen if s.outcome in ("stop", "length", "failed"))


def test_prefill_stages_add_up_to_the_prefill(scraped) -> None:
    """Every prefill charges its wall time to exactly one stage at a time: past the queue, the
    stages' sums make up the prefill's, which starts at the same lap (the response after the
    last lap is the only part left out), and compute is most of a cold prefill here."""
    client = scraped.client

    def value(expr: str) -> float:
        result = client.query(expr, at_s=scraped.at_s)
        assert result, expr
        return float(result[0]["value"][1])

    stages = {s["metric"]["stage"]: float(s["value"][1])
              for s in client.query("sum by (stage) (tidekv:prefill_stage_seconds_sum)", at_s=scraped.at_s)}
    assert set(stages) == {"queue", "reuse", "compute", "push", "verdict", "store"}
    prefill = value("sum(tidekv:prefill_seconds_sum)")
    assert value("sum(tidekv:prefill_stage_seconds_count)") == 6 * value("sum(tidekv:prefill_seconds_count)")
    assert 0.9 * prefill <= sum(stages.values()) - stages["queue"] <= prefill * 1.001
    assert stages["compute"] > 0.5 * prefill


def test_tenant_label_stays_bounded(scraped) -> None:
    client, seen = scraped.client, scraped.seen
    assert len({s.tenant for s in seen}) >= NUM_DISTINCT_TENANTS
    result = client.query("count by (tenant) (tidekv:requests_total)")
    tenants = {s["metric"]["tenant"] for s in result}
    assert tenants <= {*ALLOWED_TENANTS, DEFAULT_TENANT, OTHER_TENANT}, tenants
    assert OTHER_TENANT in tenants and "acme" in tenants


def test_kv_moves_and_transfer_faults_are_counted(scraped) -> None:
    client = scraped.client
    for expr in ('sum(tidekv:kv_demotions_total{tier="dram"})', 'sum(tidekv:kv_promotions_total{tier="ssd"})',
                 'sum(tidekv:kv_hits_total{tier="ssd"})', 'sum(tidekv:transfer_checksum_failures_total)',
                 'sum(tidekv:transfer_aborted_total{direction="send"})',
                 'sum(tidekv:transfer_aborted_total{direction="recv"})'):
        result = client.query(expr)
        assert result and float(result[0]["value"][1]) >= 1, f"{expr} -> {result}"


def test_dashboard_snapshot_draws_every_panel_with_data(scraped, tmp_path) -> None:
    promql.wait_until_all_pass(scraped.client, promql.queries(), timeout_s=10, at_s=scraped.at_s)
    assert snapshots.main(["dashboard", "--snapshot", str(tmp_path), "--prometheus", scraped.client.url,
                           "--range", "120", "--step", "2"]) == 0
    panels = {name: panels_of(d) for name, d in promql.dashboards().items()}
    for name, expected in panels.items():
        pngs = sorted((tmp_path / name).glob("*.png"))
        assert len(pngs) == len(expected), f"{name}: {len(pngs)} PNGs for {len(expected)} panels"
        for png in pngs:
            image = matplotlib.image.imread(png)
            inked = (image[..., :3].min(axis=-1) < 0.6).mean()  # darker than light grey: lines, bars, text
            assert image.shape[0] > 100 and inked > 0.01, f"{png.name}: nearly blank ({inked:.3%} inked)"
    rendered = snapshots.snapshot(scraped.client.url, tmp_path / "again", range_s=120, step_s=2)
    empty = [f"{r.dashboard}/{r.title}" for r in rendered if not r.num_points]
    assert not empty, f"panels drawn without data: {empty}"


def _run_in_pty(argv: list[str], timeout_s: float) -> str:
    """Runs argv with a pseudo-terminal as its stdio; returns everything it wrote."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                            cwd=promql.ROOT, env={**os.environ, "TERM": "xterm"})
    os.close(slave)
    out, until = b"", time.monotonic() + timeout_s
    try:
        while time.monotonic() < until:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=10) == 0, out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return out.decode(errors="replace")


def test_top_refreshes_in_a_pseudo_terminal(scraped) -> None:
    screen = _run_in_pty([sys.executable, "-m", "observe.top", "--endpoint", scraped.metrics_address,
                          "--iterations", "2", "--interval", "0.5"], timeout_s=60)
    screens = screen.split(top.CLEAR)[1:]
    assert len(screens) == 2, screen
    last = screens[-1]
    assert re.search(r"TTFT p50 +\d+\.\d ms +p99 +\d+\.\d ms", last), last
    assert re.search(r"hit ratio +\d+\.\d%", last), last
    for needle in ("prefill-0", "decode-0", "dram", "ssd", "workers   prefill 1  decode 1"):
        assert needle in last, f"{needle!r} not on the screen:\n{last}"


def test_top_reads_the_same_view_from_prometheus(scraped) -> None:
    args = argparse.Namespace(prometheus=scraped.client.url, endpoint="", workers="")
    text = top.Screen(top.Samples(top.read_all(args)), None, 0.0, scraped.client.url).render()
    assert "prefill-0" in text and "decode-0" in text and "dram" in text, text
    assert re.search(r"TTFT p50 +\d+\.\d ms", text), text
