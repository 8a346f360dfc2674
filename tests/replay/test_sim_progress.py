"""The simulator's status line (``replay.progress.SimProgress``): every record passes on
unchanged and in order, the line counts them, and ``tidekv simulate`` shows it on stderr."""

from __future__ import annotations

import io
import json

from deploy.cli import main as tidekv
from replay.progress import SimProgress
from replay.records import RequestRecord
from replay.sim.sinks import KeptRecords
from replay.traces import SYNTHETIC_TRACE


def _record(i: int, outcome: str) -> RequestRecord:
    return RequestRecord(request_id=f"r{i}", index=i, source="simulated", outcome=outcome, scheduled_s=float(i),
                         arrival_s=float(i), prompt_len=8, max_tokens=4)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_records_pass_on_and_the_line_counts_them() -> None:
    kept, stream = KeptRecords(), io.StringIO()
    progress = SimProgress(kept, 4, stream, log_every_s=3600.0)
    assert progress.in_index_order is kept.in_index_order
    records = [_record(0, "finished"), _record(1, "rejected"), _record(2, "finished")]
    for r in records:
        progress.add(r)
    assert kept.records == records
    assert progress.line().startswith("simulate: done 3/4 (75.0%: finished 2, rejected 1), arrivals up to 2.0s")
    assert "left" in progress.line()
    progress.add(_record(3, "finished"))
    summary = progress.finish(trace={}, run={})
    assert summary.counts.total == 4 and summary.counts.finished == 3
    lines = stream.getvalue().splitlines()  # to a file: the first record's line, then the last at finish
    assert len(lines) == 2 and lines[-1].startswith("simulate: done 4/4 (100.0%") and "left" not in lines[-1]


def test_on_a_terminal_the_line_is_rewritten_in_place() -> None:
    stream = _Tty()
    progress = SimProgress(KeptRecords(), 2, stream, refresh_s=0.0)
    progress.add(_record(0, "finished"))
    progress.add(_record(1, "finished"))
    progress.finish(trace={}, run={})
    out = stream.getvalue()
    assert out.count("\r\x1b[K") == 3 and out.endswith("\n") and out.count("\n") == 1


def test_tidekv_simulate_shows_the_line(tmp_path, capsys) -> None:
    rc = tidekv(["simulate", "--trace", str(SYNTHETIC_TRACE), "--block-size", "512", "--requests", "0:300",
                 "--out", str(tmp_path / "run"), "--no-plots"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "simulate: done 300/300 (100.0%" in err
    assert sum(1 for _ in (tmp_path / "run" / "requests.jsonl").open()) == 300


def test_a_trace_out_of_arrival_order_is_kept_then_written_with_the_line(tmp_path, capsys) -> None:
    """Indexes that do not rise with arrival time: the run keeps its records and writes them at
    the end (``_write_run``'s other path), with the same status line."""
    trace = tmp_path / "unsorted.jsonl"
    trace.write_text("".join(f'{{"timestamp": {t}, "input_length": 600, "output_length": 5, "hash_ids": [{h}, 9]}}\n'
                             for t, h in ((2000, 1), (0, 2), (1000, 3))))
    rc = tidekv(["simulate", "--trace", str(trace), "--block-size", "512", "--out", str(tmp_path / "run"),
                 "--no-plots"])
    assert rc == 0
    assert "simulate: done 3/3 (100.0%: finished 3" in capsys.readouterr().err
    lines = (tmp_path / "run" / "requests.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [0, 1, 2]
