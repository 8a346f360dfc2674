"""``summary.json``: the one summary computation over ``RequestRecord``s, for live and simulated runs.

``summarize(records, trace=..., run=...)`` is a pure function; ``SummaryBuilder`` is the same
computation over records given one at a time (a run of any length in bounded memory: its
latency columns spill to temporary files, ``replay.columns``, with the same figures).
``Summary`` round-trips through ``to_dict``/``from_dict`` and ``flatten`` gives the dotted
numeric view that ``report compare`` tabulates.

Definitions (all times in seconds):
- TTFT and latency over finished requests; TBT (Mooncake, ``stats.tbt_s``) and mean ITL per
  finished request with at least 2 tokens; ``itl_s`` pools every interval of every finished
  request (vLLM's ITL).
- ``send_delay_s``: actual minus scheduled arrival over all requests; large when every sender
  was busy (``max_concurrency``) and the replay fell behind the trace's arrival process.
- ``duration_s``: replay start (0) to the last request's end.
- ``slo``: over the requests that carry an SLO (``num_with_slo``: a ttft_slo_s, a tbt_slo_s or
  both; a request without one is judged by nothing and counts in none of these).
  ``num_met``: those that finished with TTFT <= their ttft_slo_s and TBT <= their tbt_slo_s
  (an absent one of the two is no constraint); ``attainment = num_met / num_with_slo``
  (rejected, failed and cancelled requests miss); ``goodput_rps = num_met / duration_s``.
  With no request carrying an SLO, ``attainment`` and ``goodput_rps`` are None (null): there
  is nothing to attain (give the run ``--ttft-slo-s`` / ``--tbt-slo-s``).
- ``cache.ratio``: sum of cached tokens / sum of prompt tokens over finished requests.
- ``workers``: per prefill worker requests, prompt and cached tokens; per decode worker
  requests and output tokens (requests that reached the worker, whatever their end).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from replay.columns import FloatColumn
from replay.records import CANCELLED, FAILED, FINISHED, OUTCOMES, REJECTED, SCHEMA_VERSION, RequestRecord
from replay.stats import LatencyStats, interval_array, meets_slo, tbt_of_intervals


@dataclass(frozen=True)
class Counts:
    total: int
    finished: int
    rejected: int
    failed: int
    cancelled: int


@dataclass(frozen=True)
class SloStats:
    num_with_slo: int  # requests that carry a TTFT or TBT SLO
    num_met: int  # of those, finished within their SLOs
    attainment: float | None  # num_met / num_with_slo; None without any SLO
    goodput_rps: float | None  # num_met / duration_s; None without any SLO


@dataclass(frozen=True)
class CacheStats:
    prompt_tokens: int
    cached_tokens: int
    ratio: float


@dataclass(frozen=True)
class Summary:
    schema_version: int
    source: str
    counts: Counts
    duration_s: float
    ttft_s: LatencyStats
    tbt_s: LatencyStats
    itl_s: LatencyStats
    latency_s: LatencyStats
    send_delay_s: LatencyStats  # actual minus scheduled arrival: > 0 when the replay fell behind
    slo: SloStats
    cache: CacheStats
    finished_rps: float
    output_tokens_per_s: float
    workers: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    trace: dict[str, Any] | None = None  # ScaledTrace.describe(), with the TraceTransform
    run: dict[str, Any] = field(default_factory=dict)  # how it ran: endpoint, concurrency, ...

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Summary:
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"summary schema_version {d.get('schema_version')!r}; this reader knows {SCHEMA_VERSION}")
        kw = dict(d)
        kw["counts"] = Counts(**d["counts"])
        for name in ("ttft_s", "tbt_s", "itl_s", "latency_s", "send_delay_s"):
            kw[name] = LatencyStats(**d[name])
        kw["slo"], kw["cache"] = SloStats(**d["slo"]), CacheStats(**d["cache"])
        return cls(**kw)

    def flatten(self) -> dict[str, float]:
        """Dotted numeric fields (``ttft_s.p50``, ``workers.prefill.prefill-0.requests``), for tables."""
        out: dict[str, float] = {}

        def walk(prefix: str, v: Any) -> None:
            if isinstance(v, dict):
                for k, x in v.items():
                    walk(f"{prefix}.{k}" if prefix else k, x)
            elif isinstance(v, int | float) and not isinstance(v, bool):
                out[prefix] = v

        d = self.to_dict()
        for skip in ("trace", "run", "schema_version"):
            d.pop(skip)
        walk("", d)
        return out


class SummaryBuilder:
    """The summary of records given one at a time, in the run's record order (by index), so a
    run of any length is summarised in bounded memory: counters per outcome and per worker,
    and a ``FloatColumn`` per latency (spilled to a temporary file past ``spill_values``
    values, its figures still exact). ``summarize`` is this over a sequence; ``finish``
    returns the ``Summary`` and closes the columns."""

    def __init__(self, spill_values: int = 1 << 16, directory: str | None = None) -> None:
        # 64 Ki values (512 KiB) a column in memory: a million-request run's columns are on disk
        # past its first few percent, so the columns' memory stays where it is from there.
        def col() -> FloatColumn:
            return FloatColumn(spill_values=spill_values, directory=directory)

        self._ttft, self._tbt, self._itl, self._latency, self._send_delay = col(), col(), col(), col(), col()
        self._by_outcome: Counter = Counter()
        self._sources: set[str] = set()
        self._prefill: dict[str, Counter] = {}
        self._decode: dict[str, Counter] = {}
        self._duration: float | None = None
        self._num_met = self._num_with_slo = self._prompt = self._cached = self._output = 0

    def add(self, r: RequestRecord) -> None:
        self._by_outcome[r.outcome] += 1
        self._sources.add(r.source)
        end_s = r.end_s
        if self._duration is None or end_s > self._duration:  # max()'s rule: the first of equals
            self._duration = end_s
        self._send_delay.append(r.arrival_s - r.scheduled_s)
        judged = r.ttft_slo_s is not None or r.tbt_slo_s is not None
        self._num_with_slo += judged
        if r.prefill_worker:
            c = self._prefill.setdefault(r.prefill_worker, Counter())
            c.update(requests=1, prompt_tokens=r.prompt_tokens or r.prompt_len, cached_tokens=r.cached_tokens)
        if r.decode_worker:
            self._decode.setdefault(r.decode_worker, Counter()).update(requests=1, output_tokens=r.num_output_tokens)
        if r.outcome != FINISHED:
            return
        gaps = interval_array(r.token_times_s)
        tbt = tbt_of_intervals(gaps)
        if tbt is not None:
            self._tbt.append(tbt)
        self._itl.extend(gaps)
        if r.ttft_s is not None:
            self._ttft.append(r.ttft_s)
        if r.latency_s is not None:
            self._latency.append(r.latency_s)
        if judged:
            self._num_met += meets_slo(r.ttft_s, tbt, r.ttft_slo_s, r.tbt_slo_s)
        self._prompt += r.prompt_tokens or r.prompt_len
        self._cached += r.cached_tokens
        self._output += r.num_output_tokens

    def _workers(self) -> dict[str, dict[str, dict[str, int]]]:
        prefill_keys, decode_keys = ("requests", "prompt_tokens", "cached_tokens"), ("requests", "output_tokens")
        return {"prefill": {w: {k: c[k] for k in prefill_keys} for w, c in sorted(self._prefill.items())},
                "decode": {w: {k: c[k] for k in decode_keys} for w, c in sorted(self._decode.items())}}

    def finish(self, *, trace: dict[str, Any] | None = None, run: dict[str, Any] | None = None) -> Summary:
        by = self._by_outcome
        assert set(by) <= set(OUTCOMES), by
        total = sum(by.values())
        duration = self._duration if self._duration is not None else 0.0
        met, judged, finished = self._num_met, self._num_with_slo, by[FINISHED]
        prompt, cached = self._prompt, self._cached
        per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
        sources = self._sources
        columns = (self._ttft, self._tbt, self._itl, self._latency, self._send_delay)
        ttft, tbt, itl, latency, send_delay = (c.stats() for c in columns)
        for c in columns:
            c.close()
        return Summary(
            schema_version=SCHEMA_VERSION, source=next(iter(sources)) if len(sources) == 1 else "mixed",
            counts=Counts(total=total, finished=finished, rejected=by[REJECTED], failed=by[FAILED],
                          cancelled=by[CANCELLED]),
            duration_s=duration, ttft_s=ttft, tbt_s=tbt, itl_s=itl, latency_s=latency, send_delay_s=send_delay,
            slo=SloStats(num_with_slo=judged, num_met=met, attainment=met / judged if judged else None,
                         goodput_rps=per_s(met) if judged else None),
            cache=CacheStats(prompt_tokens=prompt, cached_tokens=cached, ratio=cached / prompt if prompt else 0.0),
            finished_rps=per_s(finished), output_tokens_per_s=per_s(self._output),
            workers=self._workers(), trace=trace, run=dict(run or {}))


def summarize(records: Sequence[RequestRecord], *, trace: dict[str, Any] | None = None,
              run: dict[str, Any] | None = None) -> Summary:
    """The summary of one run; ``trace`` is ``ScaledTrace.describe()``. Pure."""
    builder = SummaryBuilder()
    for r in records:
        builder.add(r)
    return builder.finish(trace=trace, run=run)
