"""What the Conductor remembers about finished requests: outcome counts and the scheduler's
predicted vs observed TTFT (the last ``max_predictions`` pairs). Thread-safe; read by tests,
benchmarks and (later) the metrics endpoint."""

from __future__ import annotations

import statistics
import threading
from collections import Counter, deque


class RequestRecords:
    def __init__(self, max_predictions: int = 10_000):
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self._predictions: deque[tuple[float, float]] = deque(maxlen=max_predictions)

    def count(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] += 1

    def prediction(self, predicted_ttft_s: float, observed_ttft_s: float) -> None:
        """One request's TTFT as predicted at routing and as observed from routing to first token
        (a policy that predicts nothing records 0 and is skipped)."""
        if predicted_ttft_s > 0:
            with self._lock:
                self._predictions.append((predicted_ttft_s, observed_ttft_s))

    def prediction_error(self) -> dict[str, float]:
        """Median and p90 of |predicted - observed| / observed over the recorded requests."""
        with self._lock:
            pairs = list(self._predictions)
        errors = sorted(abs(p - o) / o for p, o in pairs if o > 0)
        if not errors:
            return {"count": 0}
        return {"count": len(errors), "median": statistics.median(errors),
                "p90": errors[min(len(errors) - 1, int(0.9 * len(errors)))]}
