"""Least-squares fits of the cost models from measurements: non-negative polynomial
regression on named features, and held-out relative errors.

Owns the numerics only (numpy; no torch, no timing). Rows are weighted by 1/measured, so the
fit minimises relative error: measured times span three orders of magnitude, and an
unweighted fit would let the longest prefills decide every coefficient. Coefficients are
constrained to be >= 0 (Lawson-Hanson NNLS, below; scipy is not a dependency), which keeps
every prediction non-negative and monotone in every feature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from costmodel.model import DECODE_TERMS, PREFILL_TERMS, FitError, LinkCost

__all__ = [
    "DECODE_TERMS", "PREFILL_TERMS", "PolyFit", "Sample", "decode_features", "fit_error", "fit_link", "fit_nonneg",
    "fit_samples", "link_features", "nnls", "pooled_error", "prefill_features", "relative_errors",
]


class Sample(NamedTuple):
    """One measured point: ``x`` the inputs (e.g. (new, reused) tokens), ``seconds`` the median time."""

    x: tuple[int, ...]
    seconds: float


def prefill_features(num_new_tokens: float, num_reused_tokens: float) -> list[float]:
    """[1, n, n*p, n*n, p]: the terms of ``CostModels.prefill_s``, in PREFILL_TERMS order."""
    n, p = float(num_new_tokens), float(num_reused_tokens)
    return [1.0, n, n * p, n * n, p]


def decode_features(batch_size: float, num_context_tokens: float) -> list[float]:
    """[1, b, c]: the terms of ``CostModels.decode_step_s``, in DECODE_TERMS order."""
    return [1.0, float(batch_size), float(num_context_tokens)]


def link_features(num_bytes: float) -> list[float]:
    """[1, bytes]: latency and seconds per byte."""
    return [1.0, float(num_bytes)]


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson & Hanson 1974, active-set method)."""
    m, k = a.shape
    x = np.zeros(k)
    passive = np.zeros(k, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, k)
    for _ in range(max_iter or 3 * k):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while passive.any():  # solve on the passive set; step back while that leaves the feasible region
            z = np.zeros(k)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            shrink = passive & (z <= 0)
            gap = x[shrink] - z[shrink]  # >= 0 since x >= 0 >= z there
            alpha = np.min(np.divide(x[shrink], gap, out=np.zeros_like(gap), where=gap > 0))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


def fit_nonneg(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative coefficients c minimising sum(((features @ c) - seconds) / seconds)^2."""
    features = np.asarray(features, dtype=float)
    seconds = np.asarray(seconds, dtype=float)
    if features.ndim != 2 or features.shape[0] != seconds.shape[0]:
        raise ValueError(f"features {features.shape} and seconds {seconds.shape} do not match")
    if (seconds <= 0).any():
        raise ValueError(f"measured times must be > 0, got {seconds.min()}")
    a = features / seconds[:, None]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0  # a term absent from the data keeps coefficient 0
    return nnls(a / scale, np.ones_like(seconds)) / scale


def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> np.ndarray:
    pred, meas = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return np.abs(pred - meas) / meas


def fit_error(errors: np.ndarray, num_fit: int) -> FitError:
    if errors.size == 0:
        return FitError(0.0, 0.0, num_fit, 0)
    return FitError(float(np.median(errors)), float(errors.max()), num_fit, int(errors.size))


class PolyFit(NamedTuple):
    coefficients: tuple[float, ...]
    error: FitError
    held_out_errors: np.ndarray

    def predict(self, features: Sequence[float]) -> float:
        return float(np.dot(self.coefficients, features))


def fit_samples(fit: Sequence[Sample], held_out: Sequence[Sample],
                features: Callable[..., list[float]]) -> PolyFit:
    """Fits on ``fit`` and scores on ``held_out`` (relative errors)."""
    if not fit:
        raise ValueError("no samples to fit")
    coefs = fit_nonneg(np.array([features(*s.x) for s in fit]), np.array([s.seconds for s in fit]))
    pred = [float(np.dot(coefs, features(*s.x))) for s in held_out]
    errors = relative_errors(pred, [s.seconds for s in held_out])
    return PolyFit(tuple(float(c) for c in coefs), fit_error(errors, len(fit)), errors)


def fit_link(fit: Sequence[Sample], held_out: Sequence[Sample]) -> tuple[LinkCost, PolyFit]:
    """Latency + bytes * seconds-per-byte from samples with x = (num_bytes,)."""
    result = fit_samples(fit, held_out, link_features)
    return LinkCost(*result.coefficients), result


def pooled_error(fits: Sequence[PolyFit]) -> FitError:
    """One FitError over the held-out points of several fits (e.g. every link and tier)."""
    errors = np.concatenate([f.held_out_errors for f in fits]) if fits else np.zeros(0)
    return fit_error(errors, sum(f.error.num_fit for f in fits))
