"""Reading ``config.json`` keys with errors that name the key (shared by the architectures)."""

from __future__ import annotations

from typing import Any


def require(d: dict[str, Any], key: str, prefix: str = "") -> Any:
    """``d[key]``; ValueError naming ``prefix + key`` when it is missing or null."""
    if key not in d or d[key] is None:
        raise ValueError(f"config.json: missing required key {prefix}{key}")
    return d[key]


def expect(d: dict[str, Any], key: str, allowed: tuple[Any, ...], prefix: str = "") -> None:
    """ValueError naming the key when ``d[key]`` is present and not one of ``allowed``."""
    if d.get(key) is not None and d[key] not in allowed:
        raise ValueError(f"config.json: {prefix}{key} must be one of {list(allowed)}, got {d[key]!r}")
