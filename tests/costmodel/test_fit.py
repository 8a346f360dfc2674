"""The fits: NNLS against its optimality conditions, exact recovery of known polynomials,
clamping, held-out scoring, and monotone predictions of a model fitted on noisy data."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.calibrate import assemble
from costmodel.fit import (
    DECODE_TERMS,
    PREFILL_TERMS,
    Sample,
    decode_features,
    fit_link,
    fit_nonneg,
    fit_samples,
    nnls,
    prefill_features,
)
from costmodel.model import CalibrationInfo
from kvstore.blocks import Tier

PREFILL_TRUTH = (0.04, 1.1e-3, 3e-8, 5e-8, 2e-5)  # const, n, n*p, n*n, p
DECODE_TRUTH = (4e-3, 6e-4, 9e-7)  # base, batch, context
PREFILL_GRID = [(n, p) for n in (32, 96, 256, 640, 1536) for p in (0, 256, 1024, 4096)]
HELD_OUT = [(64, 512), (448, 128), (1024, 3072)]


def poly(coefs, features, x) -> float:
    return float(np.dot(coefs, features(*x)))


def test_nnls_satisfies_the_kkt_conditions():
    rng = np.random.default_rng(0)
    for _ in range(100):
        m, k = rng.integers(3, 25), rng.integers(1, 6)
        a, b = rng.normal(size=(m, k)), rng.normal(size=m)
        x = nnls(a, b)
        gradient = a.T @ (b - a @ x)
        assert (x >= 0).all()
        assert np.allclose(gradient[x > 0], 0, atol=1e-8)  # stationary on the free set
        assert (gradient[x == 0] <= 1e-8).all()  # and no descent into the bound ones


def test_prefill_fit_recovers_known_coefficients():
    fit = [Sample(x, poly(PREFILL_TRUTH, prefill_features, x)) for x in PREFILL_GRID]
    held = [Sample(x, poly(PREFILL_TRUTH, prefill_features, x)) for x in HELD_OUT]
    result = fit_samples(fit, held, prefill_features)
    assert result.coefficients == pytest.approx(PREFILL_TRUTH, rel=1e-6)
    assert result.error.max_rel_err < 1e-9
    assert (result.error.num_fit, result.error.num_held_out) == (len(PREFILL_GRID), len(HELD_OUT))


def test_decode_and_link_fits_recover_known_coefficients():
    points = [(b, b * c) for b in (1, 2, 4, 16, 64) for c in (32, 512, 4096)]
    fit = [Sample(x, poly(DECODE_TRUTH, decode_features, x)) for x in points]
    assert fit_samples(fit, [], decode_features).coefficients == pytest.approx(DECODE_TRUTH, rel=1e-6)
    sizes = [10_000 * 4**i for i in range(6)]
    cost, result = fit_link([Sample((s,), 2e-4 + s * 3e-9) for s in sizes], [Sample((77_777,), 2e-4 + 77_777 * 3e-9)])
    assert (cost.latency_s, cost.s_per_byte) == (pytest.approx(2e-4, rel=1e-6), pytest.approx(3e-9, rel=1e-6))
    assert result.error.max_rel_err < 1e-9


def test_fit_clamps_a_negative_truth_to_zero():
    # Time that falls with reuse cannot be represented; the fit stays >= 0 instead of predicting negatives.
    fit = [Sample((n, p), 0.01 + n * 1e-3 - p * 1e-6) for n in (64, 256, 1024) for p in (0, 512, 2048)]
    coefs = fit_samples(fit, [], prefill_features).coefficients
    assert min(coefs) >= 0.0
    assert coefs[PREFILL_TERMS.index("reuse_s_per_token")] == 0.0


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="> 0"):
        fit_nonneg(np.ones((3, 2)), np.array([1.0, 0.0, 2.0]))
    with pytest.raises(ValueError, match="no samples"):
        fit_samples([], [], prefill_features)


def _noisy(truth, features, points, rng, spread=0.15) -> list[Sample]:
    return [Sample(x, poly(truth, features, x) * rng.uniform(1 - spread, 1 + spread)) for x in points]


def test_model_fitted_on_noisy_data_is_monotone_and_scored():
    rng = np.random.default_rng(1)
    prefill = (_noisy(PREFILL_TRUTH, prefill_features, PREFILL_GRID, rng),
               _noisy(PREFILL_TRUTH, prefill_features, HELD_OUT, rng))
    decode_points = [(b, b * c) for b in (1, 4, 16) for c in (64, 512, 2048)]
    decode = (_noisy(DECODE_TRUTH, decode_features, decode_points, rng),
              _noisy(DECODE_TRUTH, decode_features, [(8, 8 * 1024)], rng))
    link_sizes = [40_000 * 2**i for i in range(7)]

    def link(latency_s, s_per_byte):
        return ([Sample((s,), (latency_s + s * s_per_byte) * rng.uniform(0.9, 1.1)) for s in link_sizes],
                [Sample((100_000,), latency_s + 100_000 * s_per_byte)])

    models = assemble((1280, 299008), prefill, decode, {"tcp": link(3e-5, 4e-9), "shm": link(2e-4, 3e-9)},
                      {Tier.DRAM: link(1e-5, 1e-11), Tier.SSD: link(0.0, 2.5e-9)}, CalibrationInfo(grid="test"))
    assert set(models.fit_errors) >= {"prefill", "decode", "transfer", "link.tcp", "read.SSD"}
    assert models.fit_errors["prefill"].median_rel_err < 0.5  # a coarse sanity bound: noise is +-15%
    assert all(getattr(models, t) >= 0 for t in PREFILL_TERMS + DECODE_TERMS)
    assert_monotone(models)


def assert_monotone(models) -> None:
    """Non-decreasing predictions along every axis (shared with the end-to-end test)."""
    new = list(range(0, 4097, 64))
    for reused in (0, 512, 4096):
        times = [models.prefill_s(n, reused) for n in new]
        assert all(b >= a for a, b in zip(times, times[1:], strict=False)) and times[0] >= 0
    for n in (1, 256):
        times = [models.prefill_s(n, p) for p in range(0, 8193, 256)]
        assert all(b >= a for a, b in zip(times, times[1:], strict=False))
    steps = [models.decode_step_s(b, b * 1024) for b in range(0, 65)]
    assert steps[0] == 0.0 and all(b >= a for a, b in zip(steps, steps[1:], strict=False))
    for backend in models.links:
        for tier in (Tier.DRAM, Tier.SSD):
            times = [models.transfer_s(s, backend, tier) for s in range(0, 1 << 24, 1 << 20)]
            assert all(b >= a for a, b in zip(times, times[1:], strict=False))
