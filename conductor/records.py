"""What the Conductor remembers about finished requests: outcome counts and the scheduler's
predicted vs observed TTFT (the last ``max_predictions`` pairs), and the Conductor's metrics
(``metrics``: a ``ConductorMetrics``, disabled unless given) that the request lifecycle
reports through. Thread-safe; read by tests, benchmarks and the metrics endpoint.

Who reports what to ``requests_total`` (each request exactly once): the lifecycle reports every
request it ends (``metrics.ended``: stop, length, cancelled, failed with the failure kind);
``count`` reports the requests that end before the lifecycle does any work: ``"invalid"`` and
``"rejected"`` (with the refusal's reason: ``queue_full`` for admission, else
``Refused.reason``). Other outcomes given to ``count`` only update ``outcomes``.
"""

from __future__ import annotations

import statistics
import threading
from collections import Counter, deque

from conductor.metrics import ConductorMetrics

PRE_WORK_OUTCOMES = {"invalid": "invalid_argument", "rejected": "unspecified"}  # outcome -> default reason


class RequestRecords:
    def __init__(self, max_predictions: int = 10_000, metrics: ConductorMetrics | None = None):
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self._predictions: deque[tuple[float, float]] = deque(maxlen=max_predictions)
        self.metrics = metrics or ConductorMetrics.disabled()

    def count(self, outcome: str, reason: str = "", tenant: str = "") -> None:
        """One request's outcome as the server saw it; ``invalid`` and ``rejected`` also go
        to the metrics (see the module docstring), with ``reason`` and ``tenant``."""
        with self._lock:
            self.outcomes[outcome] += 1
        if outcome in PRE_WORK_OUTCOMES:
            self.metrics.refused(tenant, outcome, reason or PRE_WORK_OUTCOMES[outcome])

    def prediction(self, predicted_ttft_s: float, observed_ttft_s: float) -> None:
        """One request's TTFT as predicted at routing and as observed from routing to first token
        (a policy that predicts nothing records 0 and is skipped)."""
        if predicted_ttft_s > 0:
            with self._lock:
                self._predictions.append((predicted_ttft_s, observed_ttft_s))
            self.metrics.prediction(predicted_ttft_s, observed_ttft_s)

    def prediction_error(self) -> dict[str, float]:
        """Median and p90 of |predicted - observed| / observed over the recorded requests."""
        with self._lock:
            pairs = list(self._predictions)
        errors = sorted(abs(p - o) / o for p, o in pairs if o > 0)
        if not errors:
            return {"count": 0}
        return {"count": len(errors), "median": statistics.median(errors),
                "p90": errors[min(len(errors) - 1, int(0.9 * len(errors)))]}
