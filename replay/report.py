"""Report directories: writing and reading them, and ``report compare``.

A report directory holds::

    requests.jsonl   one RequestRecord per request (replay.records)
    summary.json     Summary.to_dict() (replay.summary), with the trace transform and run settings
    *.png            replay.plots.PLOT_FILES

``write_report`` writes a run's records and summary at once; ``ReportWriter`` writes them as
the run goes (``requests.jsonl`` in batches, the summary built as records pass, the same
bytes), for a run too long to hold. ``compare_summaries(a, b)`` puts two summaries side by
side with ratios ``b / a``; ``write_comparison`` writes ``compare.md``, ``compare.json`` and
overlaid CDF plots.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from replay.records import RequestRecord, read_records, write_records
from replay.summary import Summary, SummaryBuilder

REQUESTS_FILE, SUMMARY_FILE = "requests.jsonl", "summary.json"


@dataclass(frozen=True)
class Report:
    path: Path
    records: tuple[RequestRecord, ...]
    summary: Summary


def write_report(out_dir: str | Path, records: Sequence[RequestRecord], summary: Summary, *,
                 plots: bool = True) -> list[Path]:
    """Writes the report files (creating ``out_dir``); returns every path written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_records(out / REQUESTS_FILE, records)
    (out / SUMMARY_FILE).write_text(json.dumps(summary.to_dict(), indent=2) + "\n", encoding="utf-8")
    paths = [out / REQUESTS_FILE, out / SUMMARY_FILE]
    if plots:
        from replay.plots import plot_report  # matplotlib only when plotting

        paths += plot_report(out, records)
    return paths


class ReportWriter:
    """A report directory written while its run goes: each record appended to
    ``requests.jsonl`` (``batch_records`` lines a write) and to a ``SummaryBuilder``, then
    ``finish`` writes ``summary.json``; the files are the bytes ``write_report`` writes for the
    same records. Records must come in index order (``in_index_order``: a ``RecordSink`` of
    ``replay.sim``); ValueError otherwise. No plots: they need every record at once
    (``replay.plots.plot_report(out, read_records(...))``). Holds a batch of lines and the
    summary's bounded state, whatever the run's length."""

    in_index_order = True

    def __init__(self, out_dir: str | Path, batch_records: int = 1024) -> None:
        self.path = Path(out_dir)
        self.path.mkdir(parents=True, exist_ok=True)
        self.batch_records = batch_records
        self._builder = SummaryBuilder()
        self._lines: list[str] = []
        self._last_index: int | None = None
        self._file = (self.path / REQUESTS_FILE).open("w", encoding="utf-8")

    def add(self, record: RequestRecord) -> None:
        if self._last_index is not None and record.index <= self._last_index:
            raise ValueError(f"{self.path / REQUESTS_FILE}: records must come in index order, got index "
                             f"{record.index} after {self._last_index}")
        self._last_index = record.index
        self._lines.append(record.to_json())
        self._builder.add(record)
        if len(self._lines) >= self.batch_records:
            self._flush()

    def _flush(self) -> None:
        if self._lines:
            self._file.write("\n".join(self._lines) + "\n")
            self._lines = []

    def finish(self, *, trace: dict[str, Any] | None = None, run: dict[str, Any] | None = None) -> Summary:
        """Writes the rest of the records and ``summary.json``; returns the summary."""
        self._flush()
        self._file.close()
        summary = self._builder.finish(trace=trace, run=run)
        (self.path / SUMMARY_FILE).write_text(json.dumps(summary.to_dict(), indent=2) + "\n", encoding="utf-8")
        return summary

    def close(self) -> None:
        """Closes the records file (after a failed run: what was written stays)."""
        self._file.close()


def load_report(path: str | Path) -> Report:
    """Reads a report directory; ValueError naming the missing or malformed file."""
    p = Path(path)
    for name in (REQUESTS_FILE, SUMMARY_FILE):
        if not (p / name).is_file():
            raise ValueError(f"{p} is not a report directory: {name} is missing")
    try:
        summary = Summary.from_dict(json.loads((p / SUMMARY_FILE).read_text(encoding="utf-8")))
    except KeyError as e:
        raise ValueError(f"{p / SUMMARY_FILE}: not a summary of this schema: field {e} is missing") from None
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{p / SUMMARY_FILE}: not a summary ({e})") from None
    return Report(path=p, records=tuple(read_records(p / REQUESTS_FILE)), summary=summary)


@dataclass(frozen=True)
class ComparisonRow:
    metric: str
    a: float | None
    b: float | None
    ratio: float | None  # b / a; None (shown "-") when a is 0 (0 and 0 included) or either is missing


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a


def compare_summaries(a: Summary, b: Summary) -> list[ComparisonRow]:
    """Every numeric summary field of either run, in ``a``'s order then ``b``'s extras."""
    fa, fb = a.flatten(), b.flatten()
    keys = list(fa) + [k for k in fb if k not in fa]
    return [ComparisonRow(k, fa.get(k), fb.get(k), _ratio(fa.get(k), fb.get(k))) for k in keys]


def _cell(v: float | None) -> str:
    if v is None:
        return "-"
    return str(v) if isinstance(v, int) else f"{v:.4g}"


def format_table(rows: Sequence[ComparisonRow], label_a: str, label_b: str) -> str:
    """A markdown table (readable as plain text too)."""
    lines = [f"| metric | {label_a} | {label_b} | ratio (B/A) |", "|---|---:|---:|---:|"]
    lines += [f"| {r.metric} | {_cell(r.a)} | {_cell(r.b)} | {_cell(r.ratio)} |" for r in rows]
    return "\n".join(lines) + "\n"


def labels(a: Report, b: Report) -> tuple[str, str]:
    """What a table column and a plot's legend call each run: its directory and its source."""
    return f"A: {a.path.name} ({a.summary.source})", f"B: {b.path.name} ({b.summary.source})"


def write_comparison(out_dir: str | Path, a: Report, b: Report, *, plots: bool = True) -> tuple[str, list[Path]]:
    """Writes ``compare.md``, ``compare.json`` (and overlaid CDFs); returns the table and the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = compare_summaries(a.summary, b.summary)
    label_a, label_b = labels(a, b)
    table = format_table(rows, label_a, label_b)
    (out / "compare.md").write_text(f"# report compare\n\nA = {a.path}\nB = {b.path}\n\n{table}", encoding="utf-8")
    payload = {"a": str(a.path), "b": str(b.path), "rows": [asdict(r) for r in rows]}
    (out / "compare.json").write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    paths = [out / "compare.md", out / "compare.json"]
    if plots:
        from replay.plots import plot_compare

        paths += plot_compare(out, {label_a: a.records, label_b: b.records})
    return table, paths
