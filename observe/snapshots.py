"""``tidekv dashboard --snapshot DIR --prometheus URL``: every panel of the Grafana dashboards
rendered as a PNG with matplotlib, from the same PromQL, for a user without a Grafana server.

For each dashboard JSON (default ``deploy/grafana/*.json``) and each panel, every target is
expanded (``observe.grafana.expand``: All workers and roles, ``$__rate_interval`` = 4 steps,
at least 1 m), asked of Prometheus as a range query, and drawn: a timeseries panel as lines
(legends from ``legendFormat``), a stat panel as its last value over a sparkline, a bargauge
as horizontal bars of the last values. Files: ``DIR/<dashboard>/<NN>-<slug>.png``. A panel
whose queries return nothing is still drawn, saying "no data", and reported as such.

How a panel reads: values in its Grafana unit with SI prefixes (``observe.units``: seconds as
ms or s, bytes as kB/MB/GB, percent, req/s, tok/s), the time axis in local clock time, each
series its own colour and dash pattern (a series hidden under another still shows), a
stacked panel stacked, and the legend beside the plot, never over it.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402 - after choosing the display-less backend
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from observe.dashboard_cli import DEFAULT_DIR, main  # noqa: E402
from observe.grafana import expand, panels_of  # noqa: E402
from observe.prometheus import PrometheusClient  # noqa: E402
from observe.units import Unit, unit_of  # noqa: E402

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


# Colours cycle every 10 series, dash patterns every 4: neighbours differ in both.
DASHES = ("-", (0, (5, 2)), (0, (1, 1.5)), (0, (6, 2, 1, 2)))
MAX_SERIES = 12


def figure(panel: dict[str, Any], series: list[Series]) -> Figure:
    """The panel drawn (see the module docstring); the caller saves and closes it."""
    unit = unit_of(panel.get("fieldConfig", {}).get("defaults", {}).get("unit", ""))
    fig, ax = plt.subplots(figsize=(10, 3.6), dpi=80)
    ax.set_title(panel.get("title", ""), fontsize=11)
    if not series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_axis_off()
    elif panel.get("type") == "stat":
        _draw_stat(ax, series, unit)
    elif panel.get("type") == "bargauge":
        _draw_bars(ax, series, unit)
    else:
        _draw_lines(ax, series, unit, _stacked(panel))
    fig.tight_layout()
    return fig


def draw(panel: dict[str, Any], series: list[Series], path: Path) -> None:
    fig = figure(panel, series)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _stacked(panel: dict[str, Any]) -> bool:
    custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
    return custom.get("stacking", {}).get("mode", "none") != "none"


def _clock(ts: list[float]) -> list[datetime]:
    return [datetime.fromtimestamp(t) for t in ts]


def _draw_lines(ax: Any, series: list[Series], unit: Unit, stacked: bool) -> None:
    shown = series[:MAX_SERIES]
    if stacked:  # on the union of the series' times, a missing point counting 0
        grid = sorted({t for _, ts, _ in shown for t in ts})
        rows = [[dict(zip(ts, vs, strict=True)).get(t, 0.0) for t in grid] for _, ts, vs in shown]
        ax.stackplot(_clock(grid), rows, labels=[name[:40] for name, _, _ in shown], alpha=0.8)
    else:
        for i, (name, ts, vs) in enumerate(shown):
            ax.plot(_clock(ts), vs, label=name[:40], color=f"C{i % 10}", linestyle=DASHES[i % len(DASHES)],
                    linewidth=2.4 - 0.4 * (i % len(DASHES)), marker="o" if len(ts) <= 30 else None, markersize=3)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.set_xlabel(f"time ({time.strftime('%Z')})")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: unit.format(v)))
    ax.set_ylabel(unit.label)
    ax.grid(alpha=0.3)
    more = f" (+{len(series) - MAX_SERIES} more)" if len(series) > MAX_SERIES else ""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              title=f"{len(shown)} series{more}", title_fontsize=8)


def _draw_bars(ax: Any, series: list[Series], unit: Unit) -> None:
    names, values = [s[0] for s in series], [s[2][-1] for s in series]
    bars = ax.barh(names, values, color=[f"C{i % 10}" for i in range(len(series))])
    ax.bar_label(bars, labels=[unit.format(v) for v in values], padding=3, fontsize=9)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: unit.format(v)))
    ax.set_xlabel(unit.label)
    ax.margins(x=0.15)


def _draw_stat(ax: Any, series: list[Series], unit: Unit) -> None:
    name, ts, vs = series[0]
    ax.fill_between(_clock(ts), vs, alpha=0.25, color="tab:blue")
    ax.plot(_clock(ts), vs, color="tab:blue")
    ax.text(0.5, 0.55, unit.format(vs[-1]), ha="center", va="center", transform=ax.transAxes, fontsize=26)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: unit.format(v)))
    ax.tick_params(labelsize=7)


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


if __name__ == "__main__":
    raise SystemExit(main(["dashboard", *sys.argv[1:]]))
