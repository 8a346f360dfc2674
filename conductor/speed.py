"""How each prefill worker's requests take longer than the cost model predicts: a factor on
the engine's time, the KV hand-off every prefill adds, and the dispatch around it.

The cost models are calibrated on an idle machine and time the engine alone; a live worker
shares cores with its neighbours (on one host, the decode worker and the Conductor, and
whatever else runs there), so its prefills take longer than predicted, and by how much
changes with the load. A live request also pays for what the calibration never sees. Its
time from routing to its first token at the Conductor, as the worker reports it::

    routed ─ dispatch ─► worker queue ─► engine (reuse, compute, store) ─► hand-off ─► first token
             (Reserve,    (other          the calibrated part, x factor     (the KV push
              the RPCs)    prefills)                                         and the verdict)

After every prefill the Conductor feeds the *calibrated* prediction (before any factor: the
decision's ``Prediction.model_prefill_s``) and the worker's measured engine time, hand-off
and queue wait here, with the time from routing to the first token (``observe``).

- ``slowdown``: the ratio of exponentially decayed sums, ``sum(engine) / sum(calibrated)``
  with decay ``1 - weight`` per prefill, starting from ``PRIOR_S`` seconds of each (factor
  1). Requests decided under the same factor and finishing together do not compound it (each
  sample is against the calibration), and a prefill weighs in proportion to its length: a
  tiny one is not its fixed costs' multiple of the prediction, because those are not in it.
  Clamped to [MIN_FACTOR, MAX_FACTOR].
- ``handoff_s``: the decayed mean of the hand-off, a fixed cost per prefill (the worker
  holds its engine through it, so it counts in every queued job too).
- ``dispatch_s``: the decayed mean of what routing-to-first-token leaves once the worker's
  queue wait and prefill are taken out: the Reserve and Prefill RPCs and the Conductor's
  own work, on the cores it shares.

A worker not seen yet has the pooled pace of those seen (``Paces.unseen``: the median of
each field over them; ``Pace()``, factor 1 and no overheads, while none is), and its factor's
sums start from that factor: a worker that joins a cluster whose workers run at twice the
calibrated time is not predicted at half its real time, and so handed more than its share,
until its first prefill ends. The first sample of each mean sets it. The snapshot hands the
paces to the policy (``WorkerView``), which scales and adds them to that worker's predicted
queue and prefill times. Thread-safe.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass

MIN_FACTOR, MAX_FACTOR = 0.25, 8.0
PRIOR_S = 0.5  # seconds of engine and calibrated time a new worker starts with (factor 1)


@dataclass(frozen=True)
class Pace:
    """One prefill worker's correction of the cost model lately (see the module docstring)."""

    slowdown: float = 1.0
    handoff_s: float = 0.0
    dispatch_s: float = 0.0


class Paces(dict[str, Pace]):
    """Every seen worker's pace by worker id, and ``unseen``: the pace of a worker not in it.
    Never changed once handed out (``WorkerSpeed`` replaces it on every sample)."""

    @functools.cached_property
    def unseen(self) -> Pace:
        """The median of each field over the seen workers (the lower middle of an even count),
        ``Pace()`` when none is: computed once per map, and only when some worker is not in it."""
        if not self:
            return Pace()
        paces = list(self.values())

        def middle(values: list[float]) -> float:
            return sorted(values)[(len(values) - 1) // 2]

        return Pace(middle([p.slowdown for p in paces]), middle([p.handoff_s for p in paces]),
                    middle([p.dispatch_s for p in paces]))


class _Sums:
    __slots__ = ("engine", "calibrated", "handoff_s", "dispatch_s")

    def __init__(self, slowdown: float = 1.0) -> None:
        self.calibrated = PRIOR_S
        self.engine = PRIOR_S * slowdown
        self.handoff_s: float | None = None
        self.dispatch_s: float | None = None


def _mean(old: float | None, x: float, weight: float) -> float:
    return x if old is None else (1.0 - weight) * old + weight * x


def dispatch_of(routed_to_first_s: float, queue_s: float, prefill_s: float) -> float:
    """The dispatch of one request: routing to its first token at the Conductor less the
    worker's queue wait and prefill, to the microsecond (what is left of subtracting a time
    from itself is rounding, not dispatch), at least 0."""
    return max(0.0, round(routed_to_first_s - queue_s - prefill_s, 6))


class WorkerSpeed:
    def __init__(self, weight: float = 0.2):
        if not 0 < weight <= 1:
            raise ValueError(f"weight {weight} must be in (0, 1]")
        self.weight = weight
        self._sums: dict[str, _Sums] = {}
        # Each worker's pace as of its last sample, in a map replaced (never changed) on every
        # sample: ``paces`` hands it out as it is, once per decision.
        self._paces = Paces()
        self._lock = threading.Lock()

    def observe(self, worker_id: str, calibrated_s: float, observed_s: float, handoff_s: float = 0.0,
                dispatch_s: float | None = None) -> None:
        """One prefill on ``worker_id``: the calibrated prediction vs the worker's measured
        ``observed_s`` (its whole prefill, of which ``handoff_s`` handing off the KV);
        ``dispatch_s``: what routing to the first token took beyond the worker's queue wait and
        prefill (``dispatch_of``; None: not measured, the mean stays). A sample with
        ``calibrated_s`` or ``observed_s`` 0 is ignored."""
        if calibrated_s <= 0 or observed_s <= 0:
            return
        handoff_s = min(max(0.0, handoff_s), observed_s)
        keep, w = 1.0 - self.weight, self.weight
        with self._lock:
            s = self._sums.get(worker_id)
            if s is None:
                s = self._sums[worker_id] = _Sums(self._paces.unseen.slowdown)
            s.engine = keep * s.engine + (observed_s - handoff_s)
            s.calibrated = keep * s.calibrated + calibrated_s
            s.handoff_s = _mean(s.handoff_s, handoff_s, w)
            if dispatch_s is not None:
                s.dispatch_s = _mean(s.dispatch_s, max(0.0, dispatch_s), w)
            pace = Pace(min(MAX_FACTOR, max(MIN_FACTOR, s.engine / s.calibrated)), s.handoff_s or 0.0,
                        s.dispatch_s or 0.0)
            self._paces = Paces({**self._paces, worker_id: pace})

    def paces(self) -> Paces:
        """Every seen worker's pace, and the pace of one not seen yet (``Paces.unseen``);
        read-only: the same map until the next sample."""
        with self._lock:
            return self._paces

    def factors(self) -> Mapping[str, float]:
        """Each worker's ``Pace.slowdown``."""
        return {w: p.slowdown for w, p in self.paces().items()}
