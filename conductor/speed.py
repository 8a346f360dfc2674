"""How much slower (or faster) each prefill worker runs than the cost model predicts.

The cost models are calibrated on an idle machine; a live worker shares cores with its
neighbours (on one host, the decode worker and the Conductor), so its prefills take longer
than predicted, and by how much changes with the load. After every prefill the Conductor
feeds the worker's measured time and the *calibrated* prediction (before any factor: the
decision's ``Prediction.model_prefill_s``) here. The factor is the ratio of exponentially
decayed sums, ``sum(observed) / sum(calibrated)`` with decay ``1 - weight`` per prefill,
starting from ``PRIOR_S`` seconds of each (factor 1). So

- requests decided under the same factor and finishing together do not compound it (each
  sample is against the calibration, not against the factor in force when it was routed);
- a prefill weighs in proportion to its length: a tiny one whose fixed cost makes it 7x its
  prediction moves the factor by milliseconds' worth, not by 7x.

Clamped to [MIN_FACTOR, MAX_FACTOR]. The snapshot hands it to the policy, which scales that
worker's predicted queue and prefill times by it. A worker not seen yet has factor 1.
Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

MIN_FACTOR, MAX_FACTOR = 0.25, 8.0
PRIOR_S = 0.5  # seconds of observed and calibrated time a new worker starts with (factor 1)


class WorkerSpeed:
    def __init__(self, weight: float = 0.2):
        if not 0 < weight <= 1:
            raise ValueError(f"weight {weight} must be in (0, 1]")
        self.weight = weight
        self._sums: dict[str, tuple[float, float]] = {}  # worker -> (observed, calibrated), decayed
        self._lock = threading.Lock()

    def observe(self, worker_id: str, calibrated_s: float, observed_s: float) -> None:
        """One prefill on ``worker_id``: the calibrated prediction vs the measured seconds
        (ignored when either is 0)."""
        if calibrated_s <= 0 or observed_s <= 0:
            return
        keep = 1.0 - self.weight
        with self._lock:
            obs, cal = self._sums.get(worker_id, (PRIOR_S, PRIOR_S))
            self._sums[worker_id] = (keep * obs + observed_s, keep * cal + calibrated_s)

    def factors(self) -> Mapping[str, float]:
        with self._lock:
            return {w: min(MAX_FACTOR, max(MIN_FACTOR, obs / cal)) for w, (obs, cal) in self._sums.items()}
