"""Offline validation of dashboard JSON against Grafana's JSON Schemas (the grafana-foundation-sdk
files under ``shared/reference/grafana-schema/``): the dashboard, each panel's ``options`` and
``fieldConfig.defaults.custom`` against its kind's schema, and each target against the Prometheus
query schema. ``problems(dashboard, schema_dir)`` lists what is wrong, naming the panel. Pure
apart from reading the schema files.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

from observe.grafana import panels_of


@cache
def _schema(schema_dir: str, name: str) -> dict[str, Any]:
    return json.loads((Path(schema_dir) / f"{name}.jsonschema.json").read_text())


def _errors(instance: Any, schema: dict[str, Any], definition: str | None = None) -> list[str]:
    root = dict(schema)
    if definition is not None:
        root = {"$schema": schema.get("$schema"), "definitions": schema["definitions"],
                "$ref": f"#/definitions/{definition}"}
    out = []
    for e in jsonschema.Draft7Validator(root).iter_errors(instance):
        out.append(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}")
    return out


def problems(dashboard: dict[str, Any], schema_dir: str | Path) -> list[str]:
    """Every schema violation of ``dashboard``, each prefixed with where it is."""
    d = str(schema_dir)
    board = _schema(d, "dashboard")
    # Panels one by one (a Panel, or a RowPanel for rows), so an error names its panel instead
    # of "panels/3 is not valid under any of the given schemas".
    out = [f"dashboard: {e}" for e in _errors({**dashboard, "panels": []}, board)]
    for panel in dashboard.get("panels", []):
        kind = "RowPanel" if panel.get("type") == "row" else "Panel"
        out += [f"panel {panel.get('title')!r}: {e}" for e in _errors(panel, board, kind)]
    prom = _schema(d, "prometheus")
    for panel in panels_of(dashboard):
        where = f"panel {panel.get('title')!r} ({panel.get('type')})"
        kind = _schema(d, panel["type"])
        if "Options" in kind["definitions"]:
            out += [f"{where} options: {e}" for e in _errors(panel.get("options", {}), kind, "Options")]
        custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom")
        if custom is not None and "FieldConfig" in kind["definitions"]:
            out += [f"{where} custom: {e}" for e in _errors(custom, kind, "FieldConfig")]
        for target in panel.get("targets", []):
            out += [f"{where} target {target.get('refId')}: {e}" for e in _errors(target, prom)]
    return out
