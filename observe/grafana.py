"""Building Grafana dashboard JSON (schema version 42, Grafana 12) from small frozen values.

``Panel`` (title, kind, PromQL targets, unit, size) and ``Dashboard`` (title, uid, rows of
panels) become plain dicts with ``to_json``: a ``datasource`` variable (type prometheus) that
every panel and target refers to, and ``worker`` / ``role`` query variables (multi-value,
"All" = ``.*``) that worker-level queries filter with ``worker_id=~"$worker", role=~"$role"``.
Only fields the Grafana JSON schemas accept are written (no nulls but the first threshold's).
``expand(expr)`` substitutes the variables the way Grafana would, for evaluating a panel's
query against Prometheus directly. Pure; no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 42  # Grafana 12.x
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
KINDS = ("timeseries", "stat", "bargauge")
WORKER_FILTER = 'worker_id=~"$worker", role=~"$role"'
GRID_COLUMNS = 24


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str
    targets: tuple[Target, ...]
    unit: str = "short"
    description: str = ""
    width: int = 12
    height: int = 8
    stacked: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"panel {self.title!r}: kind {self.kind!r} not in {KINDS}")
        if not self.targets:
            raise ValueError(f"panel {self.title!r} has no query")
        if not 0 < self.width <= GRID_COLUMNS:
            raise ValueError(f"panel {self.title!r}: width {self.width} not in 1..{GRID_COLUMNS}")


def ts(title: str, *targets: Target | str, unit: str = "short", description: str = "", width: int = 12,
       stacked: bool = False) -> Panel:
    return Panel(title, "timeseries", _targets(targets), unit, description, width, 8, stacked)


def stat(title: str, *targets: Target | str, unit: str = "short", description: str = "", width: int = 4) -> Panel:
    return Panel(title, "stat", _targets(targets), unit, description, width, 4)


def bars(title: str, *targets: Target | str, unit: str = "short", description: str = "", width: int = 12) -> Panel:
    return Panel(title, "bargauge", _targets(targets), unit, description, width, 8)


def _targets(targets: tuple[Target | str, ...]) -> tuple[Target, ...]:
    return tuple(t if isinstance(t, Target) else Target(t) for t in targets)


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    tags: tuple[str, ...] = ("tidekv",)
    refresh: str = "10s"
    time_from: str = "now-1h"
    extra: dict[str, Any] = field(default_factory=dict, hash=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid, "title": self.title, "description": self.description, "tags": list(self.tags),
            "timezone": "browser", "editable": True, "graphTooltip": 1, "schemaVersion": SCHEMA_VERSION,
            "version": 1, "refresh": self.refresh, "time": {"from": self.time_from, "to": "now"},
            "annotations": {"list": [_builtin_annotation()]},
            "templating": {"list": _variables()},
            "panels": [_panel_json(p, i + 1, pos) for i, (p, pos) in enumerate(zip(self.panels, _layout(self.panels),
                                                                                     strict=True))],
        }


def _builtin_annotation() -> dict[str, Any]:
    return {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}


def _variables() -> list[dict[str, Any]]:
    def query_var(name: str, label: str, expr: str) -> dict[str, Any]:
        return {"type": "query", "name": name, "label": label, "datasource": DATASOURCE, "query": expr,
                "definition": expr, "refresh": 2, "includeAll": True, "allValue": ".*", "multi": True, "sort": 1,
                "current": {"text": ["All"], "value": ["$__all"]}, "options": [], "regex": ""}

    return [
        {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
         "current": {"text": "Prometheus", "value": "prometheus"}, "options": [], "refresh": 1, "regex": ""},
        query_var("worker", "Worker", 'label_values({__name__=~"tidekv:.*"}, worker_id)'),
        query_var("role", "Role", 'label_values({__name__=~"tidekv:.*"}, role)'),
    ]


def _layout(panels: tuple[Panel, ...]) -> list[dict[str, int]]:
    """Left to right, wrapping at 24 columns; a row is as tall as its tallest panel."""
    out, x, y, row_h = [], 0, 0, 0
    for p in panels:
        if x + p.width > GRID_COLUMNS:
            x, y, row_h = 0, y + row_h, 0
        out.append({"h": p.height, "w": p.width, "x": x, "y": y})
        x, row_h = x + p.width, max(row_h, p.height)
    return out


def _panel_json(p: Panel, panel_id: int, pos: dict[str, int]) -> dict[str, Any]:
    targets = [{"datasource": DATASOURCE, "expr": t.expr, "legendFormat": t.legend or "__auto", "range": True,
                "instant": False, "editorMode": "code", "refId": chr(ord("A") + i)} for i, t in enumerate(p.targets)]
    defaults: dict[str, Any] = {"unit": p.unit, "color": {"mode": "palette-classic"},
                                "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]}}
    if p.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                              "spanNulls": True, "stacking": {"mode": "normal" if p.stacked else "none", "group": "A"}}
    return {"id": panel_id, "type": p.kind, "title": p.title, "description": p.description, "datasource": DATASOURCE,
            "gridPos": pos, "targets": targets, "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": _options(p.kind)}


def _options(kind: str) -> dict[str, Any]:
    reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    if kind == "timeseries":
        return {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
                "tooltip": {"mode": "multi", "sort": "desc"}}
    if kind == "stat":
        return {"graphMode": "area", "colorMode": "value", "justifyMode": "auto", "textMode": "auto",
                "wideLayout": True, "showPercentChange": False, "reduceOptions": reduce,
                "percentChangeColorMode": "standard", "orientation": "auto"}
    return {"displayMode": "gradient", "valueMode": "color", "namePlacement": "auto", "showUnfilled": True,
            "sizing": "auto", "minVizWidth": 8, "minVizHeight": 16, "maxVizHeight": 300, "reduceOptions": reduce,
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False, "calcs": []},
            "orientation": "horizontal"}


_VARIABLE = re.compile(r"\$\{?(__rate_interval|__interval|__range|worker|role)\}?")


def expand(expr: str, rate_interval: str = "1m", worker: str = ".*", role: str = ".*") -> str:
    """``expr`` with Grafana's variables replaced (All = ``.*``), ready for Prometheus."""
    values = {"__rate_interval": rate_interval, "__interval": rate_interval, "__range": rate_interval,
              "worker": worker, "role": role}
    return _VARIABLE.sub(lambda m: values[m.group(1)], expr)


def panels_of(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel of a dashboard's JSON, rows' nested panels included."""
    out = []
    for p in dashboard.get("panels", []):
        out.append(p)
        out += p.get("panels", [])
    return [p for p in out if p.get("type") != "row"]
