"""A column of one latency over a whole run (every finished request's TTFT, every token
interval), held in memory up to ``spill_values`` values and past that in a temporary file,
so a run of any length holds a bounded amount of it; and its ``LatencyStats``, the same
figures ``LatencyStats.of`` gives over all the values at once, bit for bit, read back in
chunks of at most ``chunk_values``.

Why the figures of a spilled column are exact (``tests/replay/test_columns.py`` checks them
against numpy on random columns, so a numpy that changes its arithmetic fails there):

- mean: numpy sums a contiguous float64 array pairwise; an array of more than 128 values
  is split at half its length rounded down to a multiple of 8, and each half summed the
  same way. The same tree is walked here; every subtree of at most ``chunk_values`` values
  is summed by numpy itself on that slice of the file, and the halves are added as numpy
  adds them;
- percentiles (numpy's default, linear interpolation): the two order statistics numpy
  interpolates between are found by a radix select over the values' bit patterns, 16 bits
  a pass, until a candidate range holds at most ``chunk_values`` values (then it is read and
  sorted), and interpolated with numpy's formula (``numpy.lib._function_base_impl._lerp``);
- max: the max of the chunks' maxima; NaN anywhere makes every figure NaN, as in numpy.

Not thread-safe. ``close()`` removes the file (the garbage collector does too).
"""

from __future__ import annotations

import math
import struct
import tempfile
from array import array
from collections.abc import Iterable, Iterator

import numpy as np

from replay.stats import LatencyStats

_SIGN = np.uint64(1 << 63)
_DIGIT_BITS = 16
_PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE
_PERCENTILES = (50, 90, 99)  # LatencyStats' fields p50, p90, p99


class FloatColumn:
    def __init__(self, spill_values: int = 1 << 20, chunk_values: int = 1 << 20, directory: str | None = None):
        if spill_values < 1 or chunk_values < 8:
            raise ValueError(f"spill_values {spill_values} must be >= 1 and chunk_values {chunk_values} >= 8")
        self.spill_values, self.chunk_values, self.directory = spill_values, chunk_values, directory
        self._values = array("d")  # the ones not yet in the file
        self._file = None  # a TemporaryFile once anything is spilled
        self._num_spilled = 0
        self._has_nan = False

    def __len__(self) -> int:
        return self._num_spilled + len(self._values)

    def append(self, value: float) -> None:
        self._values.append(value)
        if len(self._values) >= self.spill_values:
            self._spill()

    def extend(self, values: Iterable[float]) -> None:
        """Appends ``values``; a float64 array's bytes are taken as they are (no pass in Python)."""
        if isinstance(values, np.ndarray) and values.dtype == np.float64:
            self._values.frombytes(np.ascontiguousarray(values).tobytes())
        else:
            self._values.extend(values)
        if len(self._values) >= self.spill_values:
            self._spill()

    def _spill(self) -> None:
        if not self._values:
            return
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="tidekv-column-", dir=self.directory)  # noqa: SIM115 (open until close())
        self._has_nan = self._has_nan or bool(np.isnan(np.frombuffer(self._values, dtype=np.float64)).any())
        self._file.seek(0, 2)
        self._file.write(memoryview(self._values).cast("B"))
        self._num_spilled += len(self._values)
        self._values = array("d")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._values, self._num_spilled = array("d"), 0

    # ---- the figures ----------------------------------------------------------------------------
    def stats(self) -> LatencyStats:
        """``LatencyStats.of`` of every value appended, in order (see the module docstring)."""
        if self._file is None:
            return LatencyStats.of(self._values)
        self._spill()
        self._file.flush()
        n = self._num_spilled
        if self._has_nan:
            nan = math.nan
            return LatencyStats(n, nan, nan, nan, nan, nan)
        mean = float(self._sum(0, n) / n)
        indexes = [_interpolation(n, q) for q in _PERCENTILES]
        found = self._order_stats({i for prev, nxt, _ in indexes for i in (prev, nxt)})
        p50, p90, p99 = (_lerp(found[prev], found[nxt], gamma) for prev, nxt, gamma in indexes)
        top = float(np.max(np.array([np.max(c) for c in self._chunks()])))
        return LatencyStats(n, mean, p50, p90, p99, top)

    def _read(self, start: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.float64)
        self._file.seek(start * 8)
        got = self._file.readinto(memoryview(out).cast("B"))
        assert got == count * 8, f"column file: read {got} of {count * 8} bytes at value {start}"
        return out

    def _chunks(self) -> Iterator[np.ndarray]:
        for start in range(0, self._num_spilled, self.chunk_values):
            yield self._read(start, min(self.chunk_values, self._num_spilled - start))

    def _sum(self, start: int, count: int) -> np.float64:
        """numpy's pairwise sum of values ``[start, start + count)``."""
        if count <= max(self.chunk_values, _PAIRWISE_BLOCK):  # numpy splits no block of 128 or fewer
            return np.add.reduce(self._read(start, count))
        half = count // 2
        half -= half % 8
        return self._sum(start, half) + self._sum(start + half, count - half)

    def _order_stats(self, ranks: set[int]) -> dict[int, float]:
        """The value of each 0-based rank in sorted order (a radix select over sort keys)."""
        # rank -> (rank among the candidates, their common top bits, bits below them, candidates)
        todo = {r: (r, 0, 64, self._num_spilled) for r in ranks}
        found: dict[int, float] = {}
        while todo:
            groups: dict[tuple[int, int, int], list[int]] = {}
            for r, (_, prefix, shift, count) in todo.items():
                groups.setdefault((prefix, shift, count), []).append(r)
            hist = {g: np.zeros(1 << _DIGIT_BITS, dtype=np.int64) for g in groups if g[2] > self.chunk_values}
            picked: dict[tuple[int, int, int], list[np.ndarray]] = {g: [] for g in groups if g not in hist}
            for chunk in self._chunks():
                keys = _sort_keys(chunk)
                for g in groups:
                    prefix, shift, _ = g
                    sel = keys if shift == 64 else keys[(keys >> shift) == prefix]
                    if g in hist:
                        digits = ((sel >> (shift - _DIGIT_BITS)) & 0xFFFF).astype(np.intp)
                        hist[g] += np.bincount(digits, minlength=1 << _DIGIT_BITS)
                    else:
                        picked[g].append(sel)
            for g, ranks_of_g in groups.items():
                prefix, shift, _ = g
                if g in picked:
                    ordered = np.sort(np.concatenate(picked[g]))
                    for r in ranks_of_g:
                        found[r] = _value_of_key(int(ordered[todo.pop(r)[0]]))
                    continue
                cumulative = np.cumsum(hist[g])
                for r in ranks_of_g:
                    rank = todo[r][0]
                    digit = int(np.searchsorted(cumulative, rank, side="right"))
                    before = int(cumulative[digit - 1]) if digit else 0
                    key_bits, below = (prefix << _DIGIT_BITS) | digit, shift - _DIGIT_BITS
                    if below == 0:
                        found[r] = _value_of_key(key_bits)
                        del todo[r]
                    else:
                        todo[r] = (rank - before, key_bits, below, int(hist[g][digit]))
        return found


def _sort_keys(values: np.ndarray) -> np.ndarray:
    """uint64 keys in the floats' order: negative values bit-flipped, the others' sign bit set."""
    bits = values.view(np.uint64)
    return np.where(bits >> np.uint64(63), ~bits, bits | _SIGN)


def _value_of_key(key: int) -> float:
    bits = key & ((1 << 63) - 1) if key >> 63 else ~key & ((1 << 64) - 1)
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _interpolation(n: int, q: int) -> tuple[int, int, float]:
    """numpy's ``percentile(a, q)`` for ``n`` values (method "linear", ``q`` a Python int):
    the ranks it interpolates between and the weight, as ``_quantile`` computes them."""
    virtual = (n - 1) * np.true_divide(q, 100)
    if virtual >= n - 1:  # numpy takes the last value twice, with index -1
        return n - 1, n - 1, float(virtual - (-1))
    previous = int(np.floor(virtual))
    return previous, previous + 1, float(virtual - previous)


def _lerp(a: float, b: float, t: float) -> float:
    """numpy's ``_lerp``: from ``b`` back when ``t >= 0.5``, else from ``a`` forward."""
    a64, b64 = np.float64(a), np.float64(b)
    diff = b64 - a64
    return float(b64 - diff * (1 - t) if t >= 0.5 else a64 + diff * t)
