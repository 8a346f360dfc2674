"""Checking dashboards and rules against a real Prometheus: every panel query and every
recording rule must return at least one sample with a finite value."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import yaml

from observe.grafana import expand, panels_of
from observe.prometheus import RULES_PATH, PrometheusClient, PrometheusError

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = ROOT / "deploy" / "grafana"
SCHEMA_DIR = ROOT / "data" / "grafana-schema"
NAME = re.compile(r"\btidekv:[A-Za-z0-9_:]+")


def dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES_PATH.read_text())["groups"] for r in g["rules"]]


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target of every dashboard and every recording rule."""
    out = [(f"dashboard {name} / panel {panel['title']!r}", target["expr"])
           for name, d in dashboards().items() for panel in panels_of(d) for target in panel["targets"]]
    out += [(f"rule {r['record']}", r["expr"]) for r in rules()]
    return out


def metric_names(expr: str) -> set[str]:
    return set(NAME.findall(expr))


def failing(client: PrometheusClient, checks: list[tuple[str, str]], at_s: float | None = None) -> list[str]:
    """The checks whose query returns no sample with a finite value at ``at_s`` (default: now),
    each with its reason."""
    out = []
    for where, expr in checks:
        try:
            result = client.query(expand(expr), at_s=at_s)
        except PrometheusError as e:
            out.append(f"{where}: {expr}: {e}")
            continue
        values = [float(s["value"][1]) for s in result]
        if not any(math.isfinite(v) for v in values):
            out.append(f"{where}: {expr} -> {values or 'no series'}")
    return out


def wait_until_all_pass(client: PrometheusClient, checks: list[tuple[str, str]], timeout_s: float,
                        at_s: float | None = None) -> list[str]:
    """Polls until every check passes or ``timeout_s`` passes; returns what still fails.

    With ``at_s`` (a moment just after the workload) the answers no longer depend on how long
    ago the workload ended: a rate over a window that has slid past it is 0, a ratio 0/0."""
    until = time.monotonic() + timeout_s
    while True:
        bad = failing(client, checks, at_s)
        if not bad or time.monotonic() > until:
            return bad
        time.sleep(1.0)


def wait_for(client: PrometheusClient, expr: str, want: float, timeout_s: float) -> float | None:
    """The value of a one-sample query once it equals ``want`` (None: another value at the end)."""
    until = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < until:
        result = client.query(expr)
        value = float(result[0]["value"][1]) if result else None
        if value == want:
            return value
        time.sleep(0.5)
    return value
