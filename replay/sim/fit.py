"""The live cluster's overheads (``costmodel.overheads.ClusterOverheads``), fitted from the
per-request records of a live replay: what an operator runs once per cluster shape and host
(``python -m replay.sim.fit LIVE_REPORT_DIR --calibration FILE --out FILE``), then simulates
with (``tidekv simulate --overheads FILE``). Fit on one window of requests and check the
simulator on another; never on the same requests (``bench/fidelity.py`` does both).

Every estimate reads only what a live ``requests.jsonl`` holds (arrival, queue, token times,
prompt and cached tokens, workers), with the calibration for the decode step:

- ``dispatch_s``: the median ``queue_s`` (arrival at the Conductor to the Prefill call).
- prefill: every prefill's worker time as its worker timed it (``prefill_worker_s``, from the
  stream's terminal timing; pulls left out: their time is the link model's), with its new,
  reused and copied-in tokens (``loaded_cached_tokens``: reused, but not in place). An older
  report without the worker's time gives it for back-to-back prefills only: a worker runs
  one prefill at a time, so when a request was already waiting at its worker as the
  previous one's first token came back, its worker time is the gap between the two first
  tokens. ``CostModels.prefill_s``'s formula and ``reuse_load_s_per_token`` are fitted on
  them by non-negative least squares on the seconds, not on relative errors: the queue a
  worker builds drains at the sum of its prefills' times, which the many short prefills of a
  cached window would otherwise decide. The n*p and n*n terms are fitted only with at least
  ``MIN_LONG_PREFILLS`` prefills of ``LONG_PREFILL_TOKENS`` new tokens or more, else they
  stay 0: a mostly cached window holds a handful, and the host's drift on those would set
  the curvature. The kept prefills' live over fitted times, scaled to a mean of 1, give
  ``prefill_ratio_quantiles``: the simulator draws each prefill's time around the fit's with
  the live spread (without it, a window of many alike prefills has one simulated TTFT, and
  its p50 jumps with the coefficients). Before the fit the worst prefill is dropped while it
  is off by more than a factor of two (at most a tenth of them): two gaps of responses that
  came back out of order are one far too short and one far too long. ``first_token_delay_s`` is the median
  of TTFT less the dispatch and the worker's time over the prefills that found their
  worker idle.
- decode: a request is in its decode worker's batch from about one step before its second
  token to its last one, which gives the batch size and context at every moment; a prefill
  starts (and pushes its reused rows) when the previous first token on its worker came back,
  and ends at its own first token. Every gap between two tokens after a request's first is
  fitted (non-negative, Huber-weighted least squares) as ``decode_step_scale * (calibrated
  step of the batch then)`` plus a stall for each event in it that costs the loop time:
  ``decode_stall_s_per_prefill`` per prefill ending on that worker,
  ``decode_stall_s_per_arrival`` per request arriving, ``decode_stall_s_per_reused_token``
  per reused token pushed to it (``costmodel.overheads`` says why each costs the loop); a
  stall whose event falls in fewer than ``MIN_EVENT_GAPS`` gaps stays 0 (decode covers a small
  share of a window, so a stall often rests on a handful of gaps). The weights keep a gap
  that holds a late token (or the short one after it) from pulling the scale, as a few gaps
  of several steps each do under plain least squares. A token's delivery
  delay is how much longer than that model its gap was, 0 when shorter. A request's join
  delay is read off its first gap (first to second token, less the median delivery delay)
  where it joined an idle loop: the gap is then the join delay and one step, stretched by
  the events after that step began; events before it paused the loop, and a join that came
  while it was paused waited for the pause (its delay, only bounded then, is left out). With
  fewer than ``MIN_IDLE_JOINS`` such joins every request counts, a busy one as its first gap
  less one and a half steps, its own prefill's stall and the stalls in it (half a step's
  wait for a boundary of a step its handling stretched): into a busy batch the first gap
  says mostly where in the step the join landed, which the simulator reproduces itself. The
  simulator draws from the delays' quantiles (the first gap is often a request's longest, so
  its spread, not only its median, decides TBT).
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

from costmodel import CostModels, load_models
from costmodel.fit import nnls, prefill_features
from costmodel.overheads import ClusterOverheads
from replay.records import FINISHED, RequestRecord, read_records

NUM_QUANTILES = 20
MIN_PREFILLS = 3
CURVATURE_TERMS = (2, 3)  # n*p and n*n, in PREFILL_TERMS order
LONG_PREFILL_TOKENS = 1000  # new tokens: a prefill this long says something about the curvature
MIN_LONG_PREFILLS = 10  # long prefills, at least, for the curvature terms to be fitted (else 0)
MAX_DROPPED_SHARE = 0.1  # of the timed prefills, at most, left out of the fit as off by over 2x
HUBER_K = 1.345  # the decode fit's outlier threshold, in robust standard deviations (95% efficient if normal)
MIN_EVENT_GAPS = 5  # gaps holding an event, at least, for its stall to be fitted (else it stays 0)
MIN_IDLE_JOINS = 5  # joins into an idle loop, at least, for the join delays to come from those alone


@dataclass(frozen=True)
class OverheadFit:
    """The fitted overheads and how many observations each part rests on."""

    overheads: ClusterOverheads
    num_prefills: int  # timed prefills behind the prefill terms
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


def prefill_observations(records: Sequence[RequestRecord]) -> list[tuple[int, int, int, float]]:
    """(new tokens, reused tokens, of those copied in, live worker seconds) of every prefill
    that did not pull: the worker's own time where the record holds it, else (an older
    report) the gap of a back-to-back prefill."""
    out = []
    for p in _prefills(records):
        r = p.record
        if r.pulled_from:
            continue
        seconds = r.prefill_worker_s if r.prefill_worker_s is not None else (
            p.first_s - p.start_s if p.back_to_back else None)
        if seconds is not None and seconds > 0:
            out.append((r.prompt_len - r.cached_tokens, r.cached_tokens, r.loaded_cached_tokens, seconds))
    return out


def _first_token_delay_s(records: Sequence[RequestRecord]) -> float:
    """The median of TTFT less the dispatch and the worker's own time, over the prefills that
    found their worker idle (nothing queued before them); 0 when the records do not hold the
    worker's time or fewer than ``MIN_PREFILLS`` found it idle."""
    delays = [p.record.ttft_s - (p.record.queue_s or 0.0) - p.record.prefill_worker_s for p in _prefills(records)
              if not p.back_to_back and not p.record.pulled_from and p.record.prefill_worker_s is not None]
    return max(0.0, statistics.median(delays)) if len(delays) >= MIN_PREFILLS else 0.0


def _plain_nnls(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative least squares on absolute errors (columns scaled for conditioning)."""
    scale = np.linalg.norm(features, axis=0)
    scale[scale == 0] = 1.0
    return nnls(features / scale, seconds) / scale


def _fit_prefill(observations: list[tuple[int, int, int, float]]) -> tuple[tuple[float, ...], float, list[float]]:
    """(the prefill coefficients, ``reuse_load_s_per_token``, the kept prefills' live over
    fitted times scaled to a mean of 1: ``prefill_ratio_quantiles``'s sample)."""
    if len(observations) < MIN_PREFILLS:
        raise ValueError(f"{len(observations)} timed prefills in the records; the fit needs at least "
                         f"{MIN_PREFILLS} (replay a longer window)")
    features = np.array([[*prefill_features(n, p), loaded] for n, p, loaded, _ in observations])
    seconds = np.array([s for *_, s in observations])
    # The curvature terms (n*p, n*n) rest on the few long prefills of a window, where the
    # host's drift is as large as they are: with fewer than MIN_LONG_PREFILLS they stay 0.
    if sum(n >= LONG_PREFILL_TOKENS for n, *_ in observations) < MIN_LONG_PREFILLS:
        features[:, list(CURVATURE_TERMS)] = 0.0
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
    # Absolute errors, not relative: a queue drains at the sum of its prefills' times, so a
    # 1.5 s prefill 20% off costs every request behind it 0.3 s, a 40 ms one 8 ms.
    fitted = _plain_nnls(features[keep], seconds[keep])
    *coefs, load_s_per_token = (float(c) for c in fitted)
    # Each kept prefill's live time over the fit's, scaled to a mean of 1: the simulator draws
    # a prefill's time from them, its expectation the fit's and its spread the live one's.
    ratios = seconds[keep] / np.maximum(features[keep] @ fitted, 1e-9)
    ratios /= ratios.mean()
    return tuple(coefs), load_s_per_token, [float(r) for r in ratios]


class _Timelines:
    """Absolute token times of the decoded requests, the batch they imply on each decode
    worker at any moment, and the events that cost each decode worker's loop time: reused
    rows pushed (at a prefill's start), prefills ending (first tokens) and arrivals."""

    def __init__(self, records: Sequence[RequestRecord], costs: CostModels):
        self.costs = costs
        self.requests = [r for r in records if r.outcome == FINISHED and len(r.token_times_s) >= 2]
        self.times = [[r.arrival_s + t for t in r.token_times_s] for r in self.requests]
        self.joined = [ts[1] - costs.decode_step_s(1, r.prompt_len) for r, ts in zip(self.requests, self.times,
                                                                                        strict=True)]
        prefills = _prefills(records)
        self.pushes = [(p.start_s, p.record.decode_worker, p.record.cached_tokens) for p in prefills
                       if p.record.cached_tokens]
        self.ends = [(p.first_s, p.record.decode_worker) for p in prefills]
        self.arrivals = [r.arrival_s for r in records]

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

    def event_list(self, worker: str, from_s: float, until_s: float) -> list[tuple[float, int, float]]:
        """(time, term, amount) of what costs ``worker``'s loop time between two tokens, term
        an index into ``_EVENT_TERMS``: prefills ending on it and arrivals in (from_s, until_s],
        reused tokens pushed to it by prefills starting in [from_s, until_s). A back-to-back
        prefill starts as the one before ends, so over a first gap (from that first token) this
        holds the next prefill's push, which the join may wait for, and not the request's own
        end, which the caller handles. In time order."""
        out = [(t, 0, 1.0) for t, w in self.ends if w == worker and from_s < t <= until_s]
        out += [(t, 1, 1.0) for t in self.arrivals if from_s < t <= until_s]
        out += [(t, 2, float(n)) for t, w, n in self.pushes if w == worker and from_s <= t < until_s]
        return sorted(out)

    def events(self, worker: str, from_s: float, until_s: float) -> list[float]:
        """``event_list``'s amounts summed per term, in ``_EVENT_TERMS`` order."""
        out = [0.0] * len(_EVENT_TERMS)
        for _, term, amount in self.event_list(worker, from_s, until_s):
            out[term] += amount
        return out


_EVENT_TERMS = ("decode_stall_s_per_prefill", "decode_stall_s_per_arrival", "decode_stall_s_per_reused_token")


def _robust_nnls(features: np.ndarray, seconds: np.ndarray, iterations: int = 30) -> np.ndarray:
    """Non-negative least squares with Huber weights (iteratively reweighted, k = 1.345 robust
    standard deviations from the median absolute residual): a gap that holds a token's delivery
    delay, or the short one after it, weighs as one gap, not as its square."""
    weights = np.ones(len(seconds))
    coefs = _plain_nnls(features, seconds)
    for _ in range(iterations):
        residuals = seconds - features @ coefs
        spread = 1.4826 * float(np.median(np.abs(residuals)))
        if spread <= 0:
            break
        weights = np.minimum(1.0, HUBER_K * spread / np.maximum(np.abs(residuals), 1e-300))
        root = np.sqrt(weights)
        new = _plain_nnls(features * root[:, None], seconds * root)
        if np.allclose(new, coefs, rtol=1e-9, atol=1e-15):
            break
        coefs = new
    return coefs


def _fit_decode(lines: _Timelines) -> tuple[float, dict[str, float], list[float], list[float]]:
    """(decode_step_scale, the event stalls by name, join delays, delivery delays)."""
    rows, gaps = [], []  # one row per gap after a request's second token: [calibrated step, *events in it]
    for r, ts in zip(lines.requests, lines.times, strict=True):
        w = r.decode_worker
        for a, b in zip(ts[1:], ts[2:], strict=False):
            rows.append([lines.step_s(w, (a + b) / 2), *lines.events(w, a, b)])
            gaps.append(b - a)
    scale, stalls = 1.0, np.zeros(len(_EVENT_TERMS))
    if rows:
        features = np.array(rows, dtype=float)
        # A stall rests on the few gaps its event falls in (decode covers a small share of a
        # window): with fewer than MIN_EVENT_GAPS, two long gaps are as likely late tokens.
        fitted = np.r_[True, (features[:, 1:] > 0).sum(axis=0) >= MIN_EVENT_GAPS]
        coefs = np.zeros(features.shape[1])
        coefs[fitted] = _robust_nnls(features[:, fitted], np.array(gaps))
        scale, stalls = (float(coefs[0]) if coefs[0] > 0 else 1.0), coefs[1:]
        delays = [max(0.0, g - float(f @ np.r_[scale, stalls])) for f, g in zip(features, gaps, strict=True)]
    else:
        delays = []
    median_delay = statistics.median(delays) if delays else 0.0
    idle, busy = [], []
    for i, (r, ts) in enumerate(zip(lines.requests, lines.times, strict=True)):
        step = scale * lines.step_s(r.decode_worker, ts[1])
        events = [(t, stalls[term] * amount, term) for t, term, amount in lines.event_list(r.decode_worker, *ts[:2])]
        if lines.busy_at(i, ts[0]):
            # Its own prefill's end (at ts[0]) stretches the step in progress, which it waits for.
            busy.append(max(0.0, ts[1] - ts[0] - 1.5 * step - stalls[0] - sum(s for _, s, _ in events)
                            - median_delay))
        else:
            join_s = _idle_join_s(ts[0], ts[1] - median_delay, step, events)
            if join_s is not None:
                idle.append(join_s)
    # Into an idle loop the first gap is the join delay and one step; into a busy batch it is
    # mostly where in the (stretched) step the join landed, so those count only when few joined idle.
    joins = idle if len(idle) >= MIN_IDLE_JOINS else idle + busy
    return scale, dict(zip(_EVENT_TERMS, (float(x) for x in stalls), strict=True)), joins, delays


def _idle_join_s(first_s: float, second_s: float, step_s: float,
                 events: list[tuple[float, float, int]]) -> float | None:
    """The join delay of a request that joined an idle loop, as ``SimDecode`` makes its second
    token: an event (time, stall s, term) before its first step started paused the loop, which
    the join waited for only if it came sooner (a prefill's end does not pause an idle loop);
    one after stretched that step. None when the join came while the loop was paused (the
    delay is then only known to be shorter)."""
    start_s = second_s - step_s - sum(s for _, s, _ in events)
    for _ in events:  # the events after the start stretched the step: find the start they imply
        later = second_s - step_s - sum(s for t, s, _ in events if t > start_s + 1e-9)  # one at the start is before it
        if later == start_s:
            break
        start_s = later
    paused_until = -math.inf
    for t, s, term in events:
        if t <= start_s and term != 0:
            paused_until = max(paused_until, t) + s
    if start_s <= paused_until + 1e-9:
        return None
    return max(0.0, start_s - first_s)


def fit_overheads(records: Sequence[RequestRecord], costs: CostModels, source: str = "live records",
                  num_quantiles: int = NUM_QUANTILES) -> OverheadFit:
    """The overheads of the live run in ``records`` (see the module docstring); ValueError when
    they hold too few back-to-back prefills to fit the prefill terms."""
    finished = [r for r in records if r.outcome == FINISHED]
    queues = [r.queue_s for r in finished if r.queue_s is not None]
    observations = prefill_observations(records)
    prefill, load_s_per_token, ratios = _fit_prefill(observations)
    lines = _Timelines(records, costs)
    scale, stalls, joins, delays = _fit_decode(lines) if lines.requests else (1.0, {}, [], [])
    probs = [100 * (i + 0.5) / num_quantiles for i in range(num_quantiles)]

    def quantiles(values: list[float]) -> tuple[float, ...]:
        return tuple(float(q) for q in np.percentile(values, probs)) if values else ()

    overheads = ClusterOverheads(
        dispatch_s=statistics.median(queues) if queues else 0.0, prefill_coefficients=prefill,
        reuse_load_s_per_token=load_s_per_token, first_token_delay_s=_first_token_delay_s(records),
        decode_join_quantiles_s=quantiles(joins), decode_step_scale=scale, **stalls,
        delivery_delay_quantiles_s=quantiles(delays), prefill_ratio_quantiles=quantiles(ratios), source=source,
        num_fit_requests=len(finished))
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
        fit = fit_overheads(records, load_models(args.calibration),
                            source=f"fit on {args.report} requests {args.requests or 'all'}")
    except ValueError as e:
        print(f"replay.sim.fit: error: {e}", file=sys.stderr)
        return 2
    fit.overheads.save(args.out)
    print(f"overheads written to {args.out}: {fit.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
