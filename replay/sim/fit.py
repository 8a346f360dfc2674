"""The live cluster's overheads (``costmodel.overheads.ClusterOverheads``), fitted from the
per-request records of a live replay: what an operator runs once per cluster shape and host
(``python -m replay.sim.fit LIVE_REPORT_DIR --calibration FILE --out FILE``), then simulates
with (``tidekv simulate --overheads FILE``). Fit on one window of requests and check the
simulator on another; never on the same requests (``bench/fidelity.py`` does both).

Every estimate reads only what a live ``requests.jsonl`` holds (arrival, queue, token times,
prompt and cached tokens, workers), with the calibration for the decode step:

- ``dispatch_s``: the median ``queue_s`` (arrival at the Conductor to the Prefill call).
- prefill: a worker runs one prefill at a time, so when a request was already waiting at its
  worker as the previous one's first token came back, its worker time is the gap between the
  two first tokens. Over those back-to-back pairs (pulls left out: their time is the link
  model's), ``CostModels.prefill_s``'s formula is fitted again (non-negative, relative least
  squares) after dropping, on a plain least-squares fit, the worst pair while it is off by
  more than a factor of two (at most a tenth of them): two responses that came back out of
  order give one pair far too short and one far too long.
- decode: a request is in its decode worker's batch from about one step before its second
  token to its last one, which gives the batch size and context at every moment; a prefill
  starts (and pushes its reused rows, which cost its decode worker's loop the stall there and
  then) when the previous first token on its worker came back. Each request's decode span
  from second to last token is fitted as ``decode_step_scale * (calibrated steps) +
  decode_stall_s_per_reused_token * (reused tokens pushed to its decode worker meanwhile)``.
  A token's delivery delay is how much longer than that its gap was, 0 when shorter (delays
  are sparse: a delayed token's successor catches up). A request's join delay is its first gap
  (first to second token) less one step (one and a half when the batch was busy: half a
  step's wait for its boundary), the stalls in it and the median delivery delay; the
  simulator draws from their quantiles (the first gap is often a request's longest, so its
  spread, not only its median, decides TBT).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from costmodel import CostModels
from costmodel.fit import fit_nonneg, nnls, prefill_features
from costmodel.overheads import ClusterOverheads
from replay.records import FINISHED, RequestRecord, read_records

NUM_QUANTILES = 20
MIN_PREFILLS = 3
MAX_DROPPED_SHARE = 0.1  # of the back-to-back prefills, at most, left out of the fit as out of order


@dataclass(frozen=True)
class OverheadFit:
    """The fitted overheads and how many observations each part rests on."""

    overheads: ClusterOverheads
    num_prefills: int  # back-to-back prefills behind the prefill terms
    num_decode_requests: int  # requests with two tokens or more behind the decode terms
    num_delays: int  # token delays behind the delivery quantiles

    def describe(self) -> dict:
        return {"overheads": self.overheads.describe(), "num_prefills": self.num_prefills,
                "num_decode_requests": self.num_decode_requests, "num_delays": self.num_delays}


@dataclass(frozen=True)
class _Prefill:
    """One finished request's prefill as its worker ran it (replay clock)."""

    record: RequestRecord
    start_s: float  # the previous first token on its worker came back, or it was dispatched
    first_s: float
    back_to_back: bool  # it was waiting when the previous one ended: first_s - start_s is its worker time


def _prefills(records: Sequence[RequestRecord]) -> list[_Prefill]:
    by_worker: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        if r.outcome == FINISHED and r.ttft_s is not None and r.prefill_worker:
            by_worker[r.prefill_worker].append(r)
    out = []
    for rs in by_worker.values():
        rs.sort(key=lambda r: r.arrival_s + r.ttft_s)
        prev_first = -math.inf
        for r in rs:
            first, dispatched = r.arrival_s + r.ttft_s, r.arrival_s + (r.queue_s or 0.0)
            out.append(_Prefill(r, max(prev_first, dispatched), first, dispatched < prev_first))
            prev_first = first
    return out


def prefill_observations(records: Sequence[RequestRecord]) -> list[tuple[int, int, float]]:
    """(new tokens, reused tokens, live worker seconds) of every back-to-back prefill."""
    return [(p.record.prompt_len - p.record.cached_tokens, p.record.cached_tokens, p.first_s - p.start_s)
            for p in _prefills(records) if p.back_to_back and not p.record.pulled_from and p.first_s > p.start_s]


def _plain_nnls(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative least squares on absolute errors (columns scaled for conditioning)."""
    scale = np.linalg.norm(features, axis=0)
    scale[scale == 0] = 1.0
    return nnls(features / scale, seconds) / scale


def _fit_prefill(observations: list[tuple[int, int, float]]) -> tuple[float, ...]:
    if len(observations) < MIN_PREFILLS:
        raise ValueError(f"{len(observations)} back-to-back prefills in the records; the fit needs at least "
                         f"{MIN_PREFILLS} (replay a window that queues prefills)")
    features = np.array([prefill_features(n, p) for n, p, _ in observations])
    seconds = np.array([s for *_, s in observations])
    keep = np.ones(len(seconds), dtype=bool)
    # Outliers first, on a plain least-squares fit: a relative one lets a single pair measured
    # far too short (a reordered response) pull every coefficient toward it.
    while (~keep).sum() + 1 <= MAX_DROPPED_SHARE * len(seconds):
        coefs = _plain_nnls(features[keep], seconds[keep])
        off = np.abs(np.log(np.maximum(features @ coefs, 1e-9) / seconds))
        off[~keep] = -1.0
        worst = int(np.argmax(off))
        if off[worst] <= math.log(2):
            break
        keep[worst] = False
    return tuple(float(c) for c in fit_nonneg(features[keep], seconds[keep]))


class _Timelines:
    """Absolute token times of the decoded requests, the batch they imply on each decode
    worker at any moment, and the reused rows pushed to each."""

    def __init__(self, records: Sequence[RequestRecord], costs: CostModels):
        self.costs = costs
        self.requests = [r for r in records if r.outcome == FINISHED and len(r.token_times_s) >= 2]
        self.times = [[r.arrival_s + t for t in r.token_times_s] for r in self.requests]
        self.joined = [ts[1] - costs.decode_step_s(1, r.prompt_len) for r, ts in zip(self.requests, self.times,
                                                                                        strict=True)]
        self.pushes = [(p.start_s, p.record.decode_worker, p.record.cached_tokens) for p in _prefills(records)
                       if p.record.cached_tokens]

    def step_s(self, worker: str, t: float) -> float:
        """The calibrated step of ``worker``'s batch at time ``t``."""
        batch = context = 0
        for r, ts, joined in zip(self.requests, self.times, self.joined, strict=True):
            if r.decode_worker == worker and joined < t <= ts[-1]:
                batch += 1
                context += r.prompt_len + sum(x < t for x in ts)
        return self.costs.decode_step_s(max(1, batch), context)

    def busy_at(self, i: int, t: float) -> bool:
        """Was another request decoding on request ``i``'s worker at ``t`` (a wait for a step boundary)?"""
        worker = self.requests[i].decode_worker
        return any(j != i and r.decode_worker == worker and joined < t <= ts[-1]
                   for j, (r, ts, joined) in enumerate(zip(self.requests, self.times, self.joined, strict=True)))

    def pushed(self, worker: str, from_s: float, until_s: float) -> int:
        """Reused tokens pushed to ``worker`` by prefills starting in [from_s, until_s)."""
        return sum(n for t, w, n in self.pushes if w == worker and from_s <= t < until_s)


def _fit_decode(lines: _Timelines) -> tuple[float, float, float, list[float]]:
    """(decode_step_scale, decode_stall_s_per_reused_token, join delays, delivery delays)."""
    rows, spans, gaps = [], [], []  # gaps: (gap s, calibrated step s, reused tokens pushed in it)
    for r, ts in zip(lines.requests, lines.times, strict=True):
        w = r.decode_worker
        # A push costs the loop its stall there and then: it lengthens the gap it falls in.
        mine = [(b - a, lines.step_s(w, (a + b) / 2), lines.pushed(w, a, b)) for a, b in zip(ts[1:], ts[2:],
                                                                                             strict=False)]
        gaps.extend(mine)
        if mine:  # second token to last: its steps and the pushes' stalls
            rows.append([sum(s for _, s, _ in mine), lines.pushed(w, ts[1], ts[-1])])
            spans.append(ts[-1] - ts[1])
    scale, stall_s = 1.0, 0.0
    if rows:  # plain least squares: a span of two tokens that arrived together has no relative error
        scale, stall_s = (float(c) for c in _plain_nnls(np.array(rows, dtype=float), np.array(spans)))
        scale = scale if scale > 0 else 1.0
    delays = [max(0.0, g - scale * s - stall_s * n) for g, s, n in gaps]
    median_delay = statistics.median(delays) if delays else 0.0
    excess = []
    for i, (r, ts) in enumerate(zip(lines.requests, lines.times, strict=True)):
        step = scale * lines.step_s(r.decode_worker, ts[1])
        wait = step * (1.5 if lines.busy_at(i, ts[0]) else 1.0)
        excess.append(ts[1] - ts[0] - wait - stall_s * lines.pushed(r.decode_worker, ts[0], ts[1]))
    return scale, stall_s, [max(0.0, e - median_delay) for e in excess], delays


def fit_overheads(records: Sequence[RequestRecord], costs: CostModels, source: str = "live records",
                  num_quantiles: int = NUM_QUANTILES) -> OverheadFit:
    """The overheads of the live run in ``records`` (see the module docstring); ValueError when
    they hold too few back-to-back prefills to fit the prefill terms."""
    finished = [r for r in records if r.outcome == FINISHED]
    queues = [r.queue_s for r in finished if r.queue_s is not None]
    observations = prefill_observations(records)
    prefill = _fit_prefill(observations)
    lines = _Timelines(records, costs)
    scale, stall_s, joins, delays = _fit_decode(lines) if lines.requests else (1.0, 0.0, [], [])
    probs = [100 * (i + 0.5) / num_quantiles for i in range(num_quantiles)]

    def quantiles(values: list[float]) -> tuple[float, ...]:
        return tuple(float(q) for q in np.percentile(values, probs)) if values else ()

    overheads = ClusterOverheads(
        dispatch_s=statistics.median(queues) if queues else 0.0, prefill_coefficients=prefill,
        decode_join_quantiles_s=quantiles(joins), decode_step_scale=scale, decode_stall_s_per_reused_token=stall_s,
        delivery_delay_quantiles_s=quantiles(delays), source=source, num_fit_requests=len(finished))
    return OverheadFit(overheads, len(observations), len(lines.requests), len(delays))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m replay.sim.fit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", help="a live replay's report directory (its requests.jsonl)")
    p.add_argument("--calibration", required=True, help="the calibration the live cluster ran with")
    p.add_argument("--requests", default="", help="START:END trace indices to fit on (default: all)")
    p.add_argument("--out", required=True, help="overheads file to write")
    args = p.parse_args(argv)
    records = read_records(Path(args.report) / "requests.jsonl")
    if args.requests:
        start, _, end = args.requests.partition(":")
        lo, hi = int(start or 0), int(end) if end else None
        records = [r for r in records if r.index >= lo and (hi is None or r.index < hi)]
    try:
        fit = fit_overheads(records, CostModels.load(args.calibration),
                            source=f"fit on {args.report} requests {args.requests or 'all'}")
    except ValueError as e:
        print(f"replay.sim.fit: error: {e}", file=sys.stderr)
        return 2
    fit.overheads.save(args.out)
    print(f"overheads written to {args.out}: {fit.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
