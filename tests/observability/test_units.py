"""Exact checks of the observability pieces without a Prometheus server: label policy, the
metrics endpoint, settings, metric naming, dashboards (generated = checked in, schema valid),
the Prometheus config files (promtool), and the terminal view's percentile arithmetic."""

from __future__ import annotations

import math
import shutil
import subprocess
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from conductor.config import ConductorConfig
from conductor.metrics import ConductorMetrics
from decode_worker.config import DecodeConfig
from decode_worker.metrics import DecodeMetrics
from kvstore.metrics import StoreMetrics
from kvstore.transfer.metrics import LinkMetrics
from observe import dashboards as generated
from observe import top
from observe.grafana import expand, panels_of
from observe.prometheus import RULES_PATH, scrape_config, write_scrape_config
from observe.schema import problems
from prefill_worker.metrics import PrefillMetrics
from runtime.metrics import DEFAULT_TENANT, OTHER_TENANT, Identity, TenantLabels, family, start_metrics
from runtime.settings import parse_config
from tests.observability import promql

IDENT = Identity("w-1", "decode", "tiny")


def test_tenant_labels_are_the_allow_list_plus_default_and_other() -> None:
    labels = TenantLabels(("acme", "globex"))
    assert [labels.label(t) for t in ("acme", "globex", "", "evil-corp", "acme2")] == [
        "acme", "globex", DEFAULT_TENANT, OTHER_TENANT, OTHER_TENANT]
    assert {labels.label(f"t{i}") for i in range(500)} == {OTHER_TENANT}
    assert set(labels.values) == {"acme", "globex", DEFAULT_TENANT, OTHER_TENANT}


def test_metrics_endpoint_serves_text_format_with_colons_and_can_be_off() -> None:
    registry = CollectorRegistry()
    family(registry, Counter, "unit_things", "doc", ("a",)).labels("x").inc(3)
    server = start_metrics("127.0.0.1", 0, registry=registry)
    try:
        request = urllib.request.Request(server.url, headers={"Accept": "application/openmetrics-text;version=1.0.0"})
        text = urllib.request.urlopen(request, timeout=5).read().decode()
        assert 'tidekv:unit_things_total{a="x"} 3.0' in text
        with pytest.raises(RuntimeError, match="cannot serve metrics"):
            start_metrics("127.0.0.1", int(server.address.rsplit(":", 1)[1]), registry=registry)
    finally:
        server.stop()
        server.stop()  # idempotent
    off = start_metrics("127.0.0.1", -1)
    assert off.address == "" and off.url == ""
    off.stop()


def test_a_family_is_shared_but_not_redefined() -> None:
    registry = CollectorRegistry()
    first = family(registry, Counter, "unit_shared", "doc", ("a",))
    assert family(registry, Counter, "unit_shared", "doc", ("a",)) is first
    with pytest.raises(ValueError, match="tidekv:unit_shared"):
        family(registry, Gauge, "unit_shared", "doc", ("a",))
    with pytest.raises(ValueError, match="tidekv:unit_shared"):
        family(registry, Counter, "unit_shared", "doc", ("b",))


def test_metrics_port_and_tenants_come_from_flags_and_environment() -> None:
    conductor = parse_config(ConductorConfig, ["--metrics-port", "9400", "--metrics-tenants", "acme, globex"])
    assert conductor.metrics_port == 9400 and conductor.metrics_tenants == ("acme", "globex")
    decode = parse_config(DecodeConfig, [], {"TIDEKV_METRICS_PORT": "-1", "TIDEKV_CONDUCTOR": "x:1"})
    assert decode.metrics_port == -1 and ConductorConfig().metrics_port == 0
    with pytest.raises(ValueError, match="metrics_port -2"):
        DecodeConfig(metrics_port=-2)
    with pytest.raises(ValueError, match="metrics_tenants lists 51"):
        ConductorConfig(metrics_tenants=tuple(f"t{i}" for i in range(51)))


def _all_families() -> set[str]:
    registry = CollectorRegistry()
    ConductorMetrics("tiny", "mooncake", registry=registry)
    DecodeMetrics(IDENT, registry)
    PrefillMetrics(Identity("p", "prefill", "tiny"), registry)
    StoreMetrics(Identity("p", "prefill", "tiny"), registry)
    LinkMetrics(Identity("p", "prefill", "tiny"), "tcp", "send", registry)
    return {fam.name for fam in registry.collect()}


def test_raw_metrics_have_one_colon_and_rules_two() -> None:
    names = _all_families()
    assert len(names) >= 30
    assert all(n.startswith("tidekv:") and n.count(":") == 1 for n in names), names
    assert all(r["record"].startswith("tidekv:") and r["record"].count(":") == 2 for r in promql.rules())


def test_disabled_metrics_record_nothing() -> None:
    metrics = ConductorMetrics.disabled()
    metrics.refused("t", "rejected", "queue_full")
    metrics.prediction(1.0, 2.0)
    metrics.ended("t", "stop", "", 10, 2, 1.0, True)
    assert not metrics.enabled
    for m in (DecodeMetrics.disabled(), PrefillMetrics.disabled(), StoreMetrics.disabled()):
        assert not m.enabled
        m.watch(object())  # registers nothing


def test_checked_in_dashboards_are_the_generated_ones() -> None:
    built = generated.build_all()
    on_disk = promql.dashboards()
    assert set(on_disk) == set(built)
    for name, d in built.items():
        text = (promql.DASHBOARD_DIR / f"{name}.json").read_text()
        assert text == generated.render(d), f"deploy/grafana/{name}.json is stale: run python -m observe.dashboards"


@pytest.mark.parametrize("name", sorted(generated.DASHBOARDS))
def test_dashboard_validates_against_the_grafana_schemas(name: str) -> None:
    d = promql.dashboards()[name]
    assert problems(d, promql.SCHEMA_DIR) == []
    assert d["schemaVersion"] == 42
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"worker", "role"} <= set(variables)
    for panel in panels_of(d):
        assert panel["datasource"]["uid"] == "${datasource}"
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])


def test_the_schema_check_finds_a_broken_panel() -> None:
    d = promql.dashboards()["overview"]
    stat_panel = next(p for p in d["panels"] if p["type"] == "stat")
    del stat_panel["options"]["reduceOptions"]
    stat_panel["gridPos"]["w"] = 30
    stat_panel["targets"][0]["expr"] = 3
    found = "\n".join(problems(d, promql.SCHEMA_DIR))
    assert f"panel {stat_panel['title']!r} (stat) options" in found and "reduceOptions" in found
    assert "gridPos/w" in found and "expr" in found


def test_variables_expand_as_grafana_would() -> None:
    expr = 'sum(rate(x{worker_id=~"$worker", role=~"${role}"}[$__rate_interval]))'
    assert expand(expr) == 'sum(rate(x{worker_id=~".*", role=~".*"}[1m]))'
    assert all("$" not in expand(e) for _, e in promql.queries())


promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install "
                                                                       "-y prometheus)")


@promtool
def test_promtool_accepts_the_rules_and_both_configs(tmp_path) -> None:
    written = write_scrape_config(tmp_path / "prometheus.yml", ["127.0.0.1:9400", "127.0.0.1:9401"], 2.0)
    for args in (["check", "rules", str(RULES_PATH)],
                 ["check", "config", str(RULES_PATH.parent / "prometheus.yml")],
                 ["check", "config", str(written)]):
        done = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_scrape_config_wants_host_port_addresses() -> None:
    with pytest.raises(ValueError, match="host:port"):
        scrape_config(["http://127.0.0.1:9400"])
    with pytest.raises(ValueError, match="at least one"):
        scrape_config([])


def test_top_percentiles_interpolate_like_histogram_quantile() -> None:
    buckets = [(0.1, 0.0), (0.2, 50.0), (0.4, 100.0), (math.inf, 100.0)]
    assert top.quantile(0.5, buckets) == pytest.approx(0.2)
    assert top.quantile(0.75, buckets) == pytest.approx(0.3)
    assert top.quantile(0.25, buckets) == pytest.approx(0.15)
    assert math.isnan(top.quantile(0.5, []))
    assert top.quantile(0.99, [(0.1, 1.0), (math.inf, 10.0)]) == pytest.approx(0.1)
