"""Grafana unit ids as a rendered panel shows them: an axis label and a value format.

``unit_of(grafana_id)`` gives a frozen ``Unit``; ``Unit.format(value)`` writes one value the way
Grafana would, with SI prefixes::

    s, ms          time              1.5 s, 250 ms, 40 µs, 2.5 min
    bytes          bytes             65.5 MB, 980 B              (decimal SI prefixes)
    Bps            bytes per second  12 MB/s
    percentunit    a fraction        45%
    percent        already percent   45%
    reqps          requests/s        3.2 req/s, 1.5k req/s
    ops            events/s          0.25/s
    short, none    a count           1.2k, 340, 0.5
    suffix:X       a count, then X   120 tok/s  (Grafana's custom unit "suffix: tok/s")

Pure functions; an unknown id is shown as a plain number with the id as its label.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_LARGE = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
_SMALL = ((1e-3, "m"), (1e-6, "µ"), (1e-9, "n"))


def _number(value: float) -> str:
    """Three significant digits, no exponent, no trailing zeros."""
    text = f"{value:.3g}"
    if "e" in text:  # .3g switches to an exponent at 1e3 or below 1e-4
        text = f"{value:.4f}".rstrip("0").rstrip(".") if abs(value) < 1 else f"{value:.0f}"
    return text


def si(value: float, symbol: str = "", small: bool = False, attach: bool = True) -> str:
    """``value`` with a decimal SI prefix (k, M, G, T; with ``small`` also m, µ, n for values
    below 1): on ``symbol`` when ``attach`` ("12 MB/s"), else on the number ("1.5k req/s"). A
    space separates number and symbol, except before a bare "/s"."""
    if not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    scale, prefix = next(((sc, p) for sc, p in _LARGE if magnitude >= sc), (1.0, ""))
    if small and not prefix and 0 < magnitude < 1:
        scale, prefix = next(((sc, p) for sc, p in _SMALL if magnitude >= sc), (1.0, ""))
    number = _number(value / scale)
    if attach and symbol:
        return _join(number, prefix + symbol)
    return _join(number + prefix, symbol)


def _join(number: str, symbol: str) -> str:
    if not symbol:
        return number
    return number + symbol if symbol.startswith("/") else f"{number} {symbol}"


def duration(seconds: float) -> str:
    """Seconds as Grafana shows them: µs, ms and s below a minute, then min and h."""
    if math.isfinite(seconds) and abs(seconds) >= 3600:
        return f"{_number(seconds / 3600)} h"
    if math.isfinite(seconds) and abs(seconds) >= 60:
        return f"{_number(seconds / 60)} min"
    return si(seconds, "s", small=True)


@dataclass(frozen=True)
class Unit:
    grafana_id: str
    label: str  # the axis label ("" for a plain count: the panel's title says what it counts)
    kind: str  # "time", "percent", "si"
    symbol: str = ""  # after the number, for kind "si"
    scale: float = 1.0  # multiplies the value first (ms -> s, percentunit -> percent)
    attach: bool = True  # the SI prefix on the symbol (MB/s), or on the number (1.5k req/s)

    def format(self, value: float) -> str:
        value *= self.scale
        if self.kind == "time":
            return duration(value)
        if self.kind == "percent":
            return f"{_number(value)}%"
        return si(value, self.symbol, attach=self.attach)


_UNITS = {
    "s": Unit("s", "seconds", "time"),
    "ms": Unit("ms", "seconds", "time", scale=1e-3),
    "bytes": Unit("bytes", "bytes", "si", "B"),
    "decbytes": Unit("decbytes", "bytes", "si", "B"),
    "Bps": Unit("Bps", "bytes/s", "si", "B/s"),
    "percentunit": Unit("percentunit", "percent", "percent", scale=100.0),
    "percent": Unit("percent", "percent", "percent"),
    "reqps": Unit("reqps", "requests/s", "si", "req/s", attach=False),
    "ops": Unit("ops", "per second", "si", "/s", attach=False),
    "short": Unit("short", "", "si"),
    "none": Unit("none", "", "si"),
    "": Unit("", "", "si"),
}


def unit_of(grafana_id: str) -> Unit:
    """The ``Unit`` of a panel's ``fieldConfig.defaults.unit``."""
    if grafana_id in _UNITS:
        return _UNITS[grafana_id]
    if grafana_id.startswith("suffix:"):
        suffix = grafana_id.removeprefix("suffix:").strip()
        return Unit(grafana_id, suffix, "si", suffix, attach=False)
    return Unit(grafana_id, grafana_id, "si")
