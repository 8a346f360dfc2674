"""Where a simulated run's records go, as each request ends (``replay.sim.run``).

``RecordSink`` is what the simulation needs of one: ``add`` per record, then ``finish`` with
the report's trace and run sections, returning the ``Summary``. ``KeptRecords`` (the
default) keeps them all and sorts them by index at the end, as a small run wants;
``replay.report.ReportWriter`` streams them to a report directory, in index order, with
the summary built as they pass (``in_index_order``), for a run of any length. ``InOrder``
puts records back into arrival order for such a sink, holding only the few that end
before an earlier request.
"""

from __future__ import annotations

from typing import Any, Protocol

from replay.records import RequestRecord
from replay.summary import Summary, summarize


class RecordSink(Protocol):
    """Where a run's records go: ``add`` each as it is made (the sink says in what order it
    needs them, ``in_index_order``), then ``finish`` once with the trace and run sections."""

    in_index_order: bool

    def add(self, record: RequestRecord) -> None: ...

    def finish(self, *, trace: dict[str, Any], run: dict[str, Any]) -> Summary: ...


class KeptRecords:
    """The default sink: every record kept, sorted by index at the end (ties in the order they
    ended), summarised with ``summarize``."""

    in_index_order = False

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def add(self, record: RequestRecord) -> None:
        self.records.append(record)

    def finish(self, *, trace: dict[str, Any], run: dict[str, Any]) -> Summary:
        self.records.sort(key=lambda rec: rec.index)
        return summarize(self.records, trace=trace, run=run)


class InOrder:
    """Hands records to ``sink`` in arrival order (``seq``), holding the few that end before an
    earlier request: some of those in flight, never the whole run. ValueError when arrival
    order is not index order (what a streaming sink needs)."""

    def __init__(self, sink: RecordSink):
        self.sink = sink
        self._held: dict[int, RequestRecord] = {}
        self._next_seq, self._last_index = 0, -1

    def add(self, seq: int, record: RequestRecord) -> None:
        self._held[seq] = record
        while self._next_seq in self._held:
            out = self._held.pop(self._next_seq)
            if out.index <= self._last_index:
                raise ValueError(f"records streamed in index order need indexes rising with arrival: request "
                                 f"{out.request_id} (index {out.index}) arrived after index {self._last_index}")
            self._last_index = out.index
            self.sink.add(out)
            self._next_seq += 1
