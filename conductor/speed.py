"""How much slower (or faster) each prefill worker runs than the cost model predicts.

The cost models are calibrated on an idle machine; a live worker shares cores with its
neighbours (on one host, the decode worker and the Conductor), so its prefills take longer
than predicted, and by how much changes with the load. After every prefill the Conductor
feeds the worker's measured time and the decision's predicted time (already scaled by the
factor in force) here, and the factor moves toward the one that would have been exact:
``factor *= 1 + weight * (observed / predicted - 1)``, clamped. The snapshot hands it to the
policy, which scales that worker's predicted queue and prefill times by it. A worker not
seen yet has factor 1. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

MIN_FACTOR, MAX_FACTOR = 0.25, 8.0


class WorkerSpeed:
    def __init__(self, weight: float = 0.2):
        if not 0 < weight <= 1:
            raise ValueError(f"weight {weight} must be in (0, 1]")
        self.weight = weight
        self._factors: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, worker_id: str, predicted_s: float, observed_s: float) -> None:
        """One prefill on ``worker_id``: predicted vs measured seconds (ignored when either is 0)."""
        if predicted_s <= 0 or observed_s <= 0:
            return
        with self._lock:
            old = self._factors.get(worker_id, 1.0)
            new = old * (1.0 + self.weight * (observed_s / predicted_s - 1.0))
            self._factors[worker_id] = min(MAX_FACTOR, max(MIN_FACTOR, new))

    def factors(self) -> Mapping[str, float]:
        with self._lock:
            return dict(self._factors)
