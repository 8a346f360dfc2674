"""``tidekv dashboard --snapshot DIR --prometheus URL``: every panel of the Grafana dashboards
rendered as a PNG with matplotlib, from the same PromQL, for a user without a Grafana server.

For each dashboard JSON (default ``deploy/grafana/*.json``) and each panel, every target is
expanded (``observe.grafana.expand``: All workers and roles, ``$__rate_interval`` = 4 steps,
at least 1 m), asked of Prometheus as a range query, and drawn: a timeseries panel as lines
(legends from ``legendFormat``), a stat panel as its last value over a sparkline, a bargauge
as horizontal bars of the last values. Files: ``DIR/<dashboard>/<NN>-<slug>.png``. A panel
whose queries return nothing is still drawn, saying "no data", and reported as such.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the display-less backend

from observe.grafana import expand, panels_of  # noqa: E402
from observe.prometheus import PrometheusClient  # noqa: E402

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "deploy" / "grafana"
Series = tuple[str, list[float], list[float]]  # legend, times (s), values


@dataclass(frozen=True)
class RenderedPanel:
    dashboard: str
    title: str
    path: Path
    num_series: int
    num_points: int


def legend(fmt: str, labels: dict[str, str]) -> str:
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()
    shown = {k: v for k, v in labels.items() if k != "__name__"}
    return ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) or labels.get("__name__", "value")


def query_panel(client: PrometheusClient, panel: dict[str, Any], start_s: float, end_s: float,
                step_s: float) -> list[Series]:
    rate_interval = f"{max(60, int(4 * step_s))}s"
    out: list[Series] = []
    for target in panel.get("targets", []):
        result = client.query_range(expand(target["expr"], rate_interval), start_s, end_s, step_s)
        for s in result:
            points = [(float(t), float(v)) for t, v in s["values"] if math.isfinite(float(v))]
            if points:
                ts, vs = zip(*points, strict=True)
                out.append((legend(target.get("legendFormat", ""), s["metric"]), list(ts), list(vs)))
    return out


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:60] or "panel"


def draw(panel: dict[str, Any], series: list[Series], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=80)
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
    ax.set_title(panel.get("title", ""), fontsize=11)
    if not series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_axis_off()
    elif panel.get("type") == "stat":
        _draw_stat(ax, series, unit)
    elif panel.get("type") == "bargauge":
        names, values = [s[0] for s in series], [s[2][-1] for s in series]
        ax.barh(names, values, color="tab:green")
        ax.set_xlabel(unit)
    else:
        t0 = min(s[1][0] for s in series)
        for name, ts, vs in series[:12]:
            ax.plot([t - t0 for t in ts], vs, label=name[:40], linewidth=1.2)
        ax.set_xlabel("seconds")
        ax.set_ylabel(unit)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _draw_stat(ax: Any, series: list[Series], unit: str) -> None:
    name, ts, vs = series[0]
    ax.fill_between(range(len(vs)), vs, alpha=0.25, color="tab:blue")
    ax.plot(range(len(vs)), vs, color="tab:blue")
    value = vs[-1]
    text = f"{value:.1%}" if unit == "percentunit" else f"{value:.4g} {unit if unit != 'short' else ''}"
    ax.text(0.5, 0.55, text.strip(), ha="center", va="center", transform=ax.transAxes, fontsize=26)
    ax.set_xticks([])


def snapshot(prometheus_url: str, out_dir: str | Path, dashboard_dir: str | Path = DEFAULT_DIR,
             range_s: float = 900.0, step_s: float = 15.0, end_s: float | None = None) -> list[RenderedPanel]:
    """Renders every panel of every dashboard in ``dashboard_dir``; returns what it drew."""
    client = PrometheusClient(prometheus_url)
    end_s = time.time() if end_s is None else end_s
    rendered = []
    for path in sorted(Path(dashboard_dir).glob("*.json")):
        dashboard = json.loads(path.read_text())
        for i, panel in enumerate(panels_of(dashboard), start=1):
            series = query_panel(client, panel, end_s - range_s, end_s, step_s)
            png = Path(out_dir) / path.stem / f"{i:02d}-{_slug(panel.get('title', ''))}.png"
            draw(panel, series, png)
            rendered.append(RenderedPanel(path.stem, panel.get("title", ""), png, len(series),
                                          sum(len(s[1]) for s in series)))
    return rendered


def add_dashboard_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``tidekv dashboard``; the parsed namespace's ``func(args)`` runs it."""
    p = subparsers.add_parser("dashboard", help="render the Grafana dashboards' panels as PNGs from a Prometheus")
    p.add_argument("--snapshot", required=True, metavar="DIR", help="directory for the PNGs")
    p.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    p.add_argument("--dashboards", default=str(DEFAULT_DIR), help="directory of dashboard JSON")
    p.add_argument("--range", dest="range_s", type=float, default=900.0, help="seconds of history (default 900)")
    p.add_argument("--step", dest="step_s", type=float, default=15.0, help="seconds between points (default 15)")
    p.set_defaults(func=run_dashboard)
    return p


def run_dashboard(args: argparse.Namespace) -> int:
    rendered = snapshot(args.prometheus, args.snapshot, args.dashboards, args.range_s, args.step_s)
    for r in rendered:
        note = "" if r.num_points else "  (no data)"
        print(f"{r.path}  {r.num_series} series, {r.num_points} points{note}", flush=True)
    empty = sum(not r.num_points for r in rendered)
    print(f"{len(rendered)} panels rendered to {args.snapshot}; {empty} without data", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``main(["dashboard", ...])``: the subcommand alone, as ``tidekv`` would parse it."""
    parser = argparse.ArgumentParser(prog="tidekv")
    add_dashboard_parser(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main(["dashboard", *sys.argv[1:]]))
