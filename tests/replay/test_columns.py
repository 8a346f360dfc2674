"""``FloatColumn``: its figures equal ``LatencyStats.of`` over the same values exactly, in
memory and spilled to its file, over random columns with ties, zeros and negative values,
at sizes around numpy's pairwise-summation splits, with tiny spill and chunk sizes so that
every path (histogram passes, a sorted candidate range, the pairwise tree) runs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replay.columns import FloatColumn
from replay.stats import LatencyStats


def column(values, **kw) -> FloatColumn:
    c = FloatColumn(**kw)
    for v in values:
        c.append(float(v))
    return c


def draws(rng: np.random.Generator, n: int, kind: str) -> list[float]:
    if kind == "spread":
        return list(rng.standard_exponential(n) * 10.0 ** rng.uniform(-4, 2, n))
    if kind == "ties":  # few distinct values: ranks fall inside long runs of equal keys
        return list(rng.choice([0.0, 0.02, 0.02, 0.021, 1.5], n))
    return list(rng.normal(0.0, 3.0, n))  # signed


@pytest.mark.parametrize("kind", ["spread", "ties", "signed"])
@pytest.mark.parametrize("n", [1, 2, 7, 9, 100, 129, 1000, 4099])
def test_a_spilled_column_gives_exactly_numpys_figures(kind: str, n: int) -> None:
    rng = np.random.default_rng(n)
    values = draws(rng, n, kind)
    expected = LatencyStats.of(values)
    for spill, chunk in ((1, 8), (5, 16), (64, 40), (10**6, 1 << 20)):
        c = column(values, spill_values=spill, chunk_values=chunk)
        assert len(c) == n
        assert c.stats() == expected, (spill, chunk)
        c.close()


def test_an_empty_column_and_one_in_memory() -> None:
    assert FloatColumn().stats() == LatencyStats.of([])
    c = FloatColumn()
    c.extend([0.5, 0.25, 1.0])
    assert c.stats() == LatencyStats.of([0.5, 0.25, 1.0])


def test_a_large_column_spills_and_matches(tmp_path) -> None:
    values = np.random.default_rng(7).standard_exponential(300_001) * 0.02
    c = FloatColumn(spill_values=50_000, chunk_values=20_000, directory=str(tmp_path))
    for start in range(0, len(values), 1000):
        c.extend(values[start:start + 1000].tolist())
    assert c._file is not None and c._num_spilled == 300_000  # the spill really happened
    assert c.stats() == LatencyStats.of(values.tolist())
    c.close()


def test_nan_makes_every_figure_nan_as_in_numpy() -> None:
    values = [0.1, math.nan, 0.3] * 5
    expected = LatencyStats.of(values)
    got = column(values, spill_values=2, chunk_values=8).stats()
    assert got.count == expected.count == 15
    assert all(math.isnan(x) for x in (got.mean, got.p50, got.p90, got.p99, got.max))
    assert all(math.isnan(x) for x in (expected.mean, expected.p50, expected.p90, expected.p99, expected.max))


def test_an_array_extends_a_column_as_its_values_would() -> None:
    values = np.random.default_rng(3).exponential(1.0, 1000)
    by_array, by_list = FloatColumn(spill_values=300), FloatColumn(spill_values=300)
    for part in np.array_split(values, 7):
        by_array.extend(part)
        by_list.extend(part.tolist())
    by_array.extend(np.arange(3, dtype=np.float32))  # not float64: converted value by value
    by_list.extend([0.0, 1.0, 2.0])
    assert len(by_array) == len(by_list) == 1003
    assert by_array.stats() == by_list.stats()
