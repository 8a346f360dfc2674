"""How a rendered panel reads (``tidekv dashboard --snapshot``): values in the panel's unit with
SI prefixes, a clock-time axis, each series its own colour and dash pattern, stacked panels
stacked, the legend beside the plot. Hand-made series; no Prometheus needed."""

from __future__ import annotations

import re
import time

import matplotlib.pyplot as plt
import pytest

from observe.snapshots import draw, figure
from observe.units import duration, si, unit_of

T0 = 1_796_000_000.0  # an epoch second; the axis shows it as local clock time


@pytest.mark.parametrize("unit,value,text", [
    ("s", 0.25, "250 ms"), ("s", 1.5, "1.5 s"), ("s", 4e-5, "40 µs"), ("s", 150.0, "2.5 min"), ("ms", 250.0, "250 ms"),
    ("bytes", 65_536_000, "65.5 MB"), ("bytes", 980, "980 B"), ("bytes", 0, "0 B"), ("Bps", 1.2e7, "12 MB/s"),
    ("percentunit", 0.452, "45.2%"), ("percent", 45.0, "45%"), ("reqps", 3.2, "3.2 req/s"),
    ("reqps", 1500, "1.5k req/s"), ("ops", 0.25, "0.25/s"), ("short", 1234, "1.23k"), ("short", 0.5, "0.5"),
    ("suffix: tok/s", 120, "120 tok/s"), ("suffix: tok/s", 2.5e6, "2.5M tok/s"),
])
def test_values_read_in_their_unit(unit, value, text):
    assert unit_of(unit).format(value) == text


def test_unit_labels_never_show_grafana_ids():
    labels = {u: unit_of(u).label for u in ("s", "bytes", "Bps", "percentunit", "reqps", "ops", "short",
                                            "suffix: tok/s")}
    assert labels == {"s": "seconds", "bytes": "bytes", "Bps": "bytes/s", "percentunit": "percent",
                      "reqps": "requests/s", "ops": "per second", "short": "", "suffix: tok/s": "tok/s"}
    assert si(1e7, "B") == "10 MB" and "e" not in si(12345.678) and duration(0.0) == "0 s"


def panel(unit: str, kind: str = "timeseries", stacked: bool = False) -> dict:
    return {"type": kind, "title": "t", "fieldConfig": {"defaults": {
        "unit": unit, "custom": {"stacking": {"mode": "normal" if stacked else "none"}}}}}


def ticks(fig, axis: str) -> list[str]:
    fig.canvas.draw()
    ax = fig.axes[0]
    labels = ax.get_yticklabels() if axis == "y" else ax.get_xticklabels()
    return [t.get_text() for t in labels if t.get_text()]


def test_a_bytes_panel_has_si_ticks_clock_time_and_a_legend_beside_it():
    times = [T0 + 15 * i for i in range(20)]
    series = [("prefill-0 dram", times, [2e6] * 20), ("prefill-0 ssd", times, [6.5e7 * i / 19 for i in range(20)])]
    fig = figure(panel("bytes"), series)
    try:
        assert all(re.fullmatch(r"-?[\d.]+ [kMG]?B", t) for t in ticks(fig, "y")), ticks(fig, "y")
        assert "60 MB" in ticks(fig, "y")
        clock = ticks(fig, "x")
        assert clock and all(re.fullmatch(r"\d\d:\d\d:\d\d", t) for t in clock), clock
        assert time.strftime("%H:%M:%S", time.localtime(T0)) <= clock[-1]
        ax = fig.axes[0]
        assert ax.get_ylabel() == "bytes" and ax.get_xlabel() == f"time ({time.strftime('%Z')})"
        legend = ax.get_legend().get_window_extent()
        assert legend.x0 >= ax.get_window_extent().x1  # beside the plot, not over the data
    finally:
        plt.close(fig)


def test_series_differ_in_colour_and_dashes_and_stacked_panels_stack():
    times = [T0 + i for i in range(5)]
    series = [(f"s{i}", times, [1.0] * 5) for i in range(6)]  # six identical series: each must still show
    fig = figure(panel("reqps"), series)
    try:
        lines = fig.axes[0].get_lines()
        styles = {(line.get_color(), str(line.get_linestyle()), line.get_linewidth()) for line in lines}
        assert len(lines) == 6 and len(styles) == 6
        assert len({line.get_color() for line in lines}) == 6 and len({line.get_linewidth() for line in lines}) >= 4
    finally:
        plt.close(fig)
    fig = figure(panel("reqps", stacked=True), series)
    try:
        assert len(fig.axes[0].collections) == 6 and fig.axes[0].get_ylim()[1] >= 6.0  # stacked to 6 req/s
    finally:
        plt.close(fig)


def test_stat_and_bar_panels_write_their_values_in_their_unit(tmp_path):
    times = [T0 + i for i in range(5)]
    fig = figure(panel("percentunit", "stat"), [("ratio", times, [0.1, 0.2, 0.3, 0.5, 0.652])])
    try:
        assert "65.2%" in [t.get_text() for t in fig.axes[0].texts]
    finally:
        plt.close(fig)
    fig = figure(panel("percentunit", "bargauge"), [("dram", times, [0.866]), ("ssd", times, [0.513])])
    try:
        assert {"86.6%", "51.3%"} <= {t.get_text() for t in fig.axes[0].texts}
        assert all(t.endswith("%") for t in ticks(fig, "x"))
    finally:
        plt.close(fig)
    draw(panel("s"), [], tmp_path / "empty.png")
    assert (tmp_path / "empty.png").stat().st_size > 0
