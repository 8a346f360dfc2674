"""``bench.scheduling.prefill_noise``: how the workers' prefill times stray from their
predictions, and whether one request's stray foretells the next one's on the same worker."""

from __future__ import annotations

import math
import random

import pytest

from bench.scheduling import prefill_noise


def _rows(worker: str, logs: list[float], predicted_s: float = 0.1) -> list[tuple[str, float, float]]:
    return [(worker, predicted_s * math.exp(x), predicted_s) for x in logs]


def test_independent_strays_show_no_autocorrelation_and_their_spread() -> None:
    rng = random.Random(7)
    out = prefill_noise(_rows("a", [rng.gauss(0.0, 0.2) for _ in range(4000)]))
    assert out["log_ratio_sd"] == pytest.approx(0.2, abs=0.01)
    assert abs(out["lag1_autocorrelation"]) < 0.05
    assert out["unforeseeable_median_error"] == pytest.approx(0.6745 * out["log_ratio_sd"], abs=1e-3)


def test_a_slow_drift_is_foreseeable_and_workers_are_followed_apart() -> None:
    drift = [0.3 * math.sin(i / 20) for i in range(400)]
    one = prefill_noise(_rows("a", drift))
    assert one["lag1_autocorrelation"] > 0.9
    # Interleaved with another worker's opposite drift: each worker's own sequence still
    # foretells itself; pairing across workers would not.
    rows = [row for pair in zip(_rows("a", drift), _rows("b", [-x for x in drift]), strict=True) for row in pair]
    assert prefill_noise(rows)["lag1_autocorrelation"] > 0.9


def test_alternating_strays_anticorrelate_and_too_few_or_unmeasured_give_none() -> None:
    assert prefill_noise(_rows("a", [0.1, -0.1] * 50))["lag1_autocorrelation"] == pytest.approx(-1.0)
    assert prefill_noise(_rows("a", [0.0] * 10))["lag1_autocorrelation"] is None  # no spread at all
    assert prefill_noise(_rows("a", [0.1, 0.2])) is None
    assert prefill_noise([("a", 0.0, 0.1)] * 5 + [("a", 0.1, 0.0)] * 5) is None  # nothing measured
