"""Report directories and ``report compare`` on hand-made records (no cluster needed)."""

import json

import matplotlib.image
import pytest

from replay.cli import main
from replay.plots import PLOT_FILES
from replay.report import compare_summaries, load_report, write_comparison, write_report
from replay.summary import summarize
from tests.replay.helpers import rec
from tests.replay.test_stats import hand_made


def assert_png(path) -> None:
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img.std() > 0  # something is drawn, not a blank canvas


def test_write_and_load_report(tmp_path):
    records = hand_made()
    summary = summarize(records, trace={"source": "x", "transform": {"rate_scale": 2.0}})
    paths = write_report(tmp_path / "r", records, summary)
    assert [p.name for p in paths] == ["requests.jsonl", "summary.json", *PLOT_FILES]
    for name in PLOT_FILES:
        assert_png(tmp_path / "r" / name)
    report = load_report(tmp_path / "r")
    assert report.records == tuple(records) and report.summary == summary
    on_disk = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert on_disk["schema_version"] == 1 and on_disk["counts"]["total"] == 6
    with pytest.raises(ValueError, match="requests.jsonl is missing"):
        load_report(tmp_path)


def test_compare_with_itself_is_all_ones_and_ratios_are_b_over_a(tmp_path):
    a = summarize(hand_made())
    rows = compare_summaries(a, a)
    assert rows and all(r.ratio == 1.0 for r in rows if r.a) and all(r.ratio is None for r in rows if not r.a)
    b = summarize([*hand_made(), rec(9, arrival=5.0, ttft=2.0, gaps=(0.1,))])
    by = {r.metric: r for r in compare_summaries(a, b)}
    assert by["counts.total"].ratio == pytest.approx(7 / 6)
    assert by["counts.rejected"].ratio == 1.0
    assert (by["counts.cancelled"].a, by["counts.cancelled"].b, by["counts.cancelled"].ratio) == (0, 0, None)
    assert by["ttft_s.max"].b == pytest.approx(2.0)


def test_report_compare_cli(tmp_path, capsys):
    records = hand_made()
    write_report(tmp_path / "a", records, summarize(records), plots=False)
    write_report(tmp_path / "b", records, summarize(records), plots=False)
    assert main(["report", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "| ttft_s.p50 |" in out and "ratio (B/A)" in out and "| metric | A: a (live) | B: b (live) |" in out
    rows = json.loads((tmp_path / "c" / "compare.json").read_text())["rows"]
    assert rows and all(r["ratio"] == (1.0 if r["a"] else None) for r in rows)
    table = (tmp_path / "c" / "compare.md").read_text()
    assert "| counts.total | 6 | 6 | 1 |" in table and "| counts.cancelled | 0 | 0 | - |" in table
    for name in ("compare_ttft_cdf.png", "compare_tbt_cdf.png"):
        assert_png(tmp_path / "c" / name)
    assert main(["report", "compare", str(tmp_path / "a"), str(tmp_path / "nope")]) == 2


def test_compare_plots_name_each_run(tmp_path, monkeypatch):
    import replay.plots

    seen = {}
    monkeypatch.setattr(replay.plots, "plot_compare", lambda out, runs: seen.update(runs) or [])
    records = hand_made()
    write_report(tmp_path / "live-report", records, summarize(records), plots=False)
    write_report(tmp_path / "sim-report", records, summarize([rec(0, source="simulated")]), plots=False)
    write_comparison(tmp_path / "c", load_report(tmp_path / "live-report"), load_report(tmp_path / "sim-report"))
    assert list(seen) == ["A: live-report (live)", "B: sim-report (simulated)"]


def test_write_comparison_without_plots(tmp_path):
    records = hand_made()
    write_report(tmp_path / "a", records, summarize(records), plots=False)
    table, paths = write_comparison(tmp_path / "c", load_report(tmp_path / "a"), load_report(tmp_path / "a"),
                                    plots=False)
    assert [p.name for p in paths] == ["compare.md", "compare.json"] and table.startswith("| metric |")


def test_a_record_line_reads_back_as_json_would_write_it():
    """Records are written by orjson: each line holds json's values (only a float far from 1
    may be spelt otherwise), and json writes the records orjson would write differently."""
    import random

    from replay.records import RequestRecord

    rng = random.Random(5)
    gaps = tuple(rng.choice((1e-7, 2.5e-5, 0.02, 0.1 + rng.random(), 3e5)) for _ in range(200))
    plain = rec(1, gaps=gaps, ttft=9.999999997489795e-05, predicted_ttft_s=1e-300, ttft_slo_s=2.0)
    line, by_json = plain.to_json(), json.dumps(plain.to_dict(), separators=(",", ":"))
    assert line != by_json  # orjson wrote it: it spells 9.99...e-05 as 0.0000999...
    assert json.loads(line) == json.loads(by_json)
    assert RequestRecord.from_dict(json.loads(line)) == plain
    for odd in (rec(2, gaps=(float("nan"),)), rec(3, ttft_slo_s=float("inf")), rec(4, prompt=1 << 70)):
        assert odd.to_json() == json.dumps(odd.to_dict(), separators=(",", ":"))  # json's NaN, Infinity, big int
    assert "NaN" in rec(2, gaps=(float("nan"),)).to_json()
