"""The calibration file: ``CostModels`` as versioned JSON, written atomically and read back
with every field checked.

Layout (version 1)::

    {"format": "tidekv-calibration", "version": 1,
     "info": {"model_fingerprint": ..., "device": "cpu", "torch_threads": 1, "grid": "quick", ...},
     "kv_bytes_per_token": 1280, "snapshot_bytes": 299008,
     "coefficients": {"prefill_const_s": ..., ..., "decode_s_per_context_token": ...},   seconds
     "links": {"tcp": {"latency_s": ..., "s_per_byte": ...}, "shm": {...}},
     "tier_reads": {"DRAM": {"latency_s": ..., "s_per_byte": ...}, "SSD": {...}},
     "fit_errors": {"prefill": {"median_rel_err": ..., "max_rel_err": ..., "num_fit": ..., "num_held_out": ...}}}

Any defect raises ``CalibrationError`` whose message starts with the path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from costmodel.model import (
    COEFFICIENTS,
    FORMAT_NAME,
    FORMAT_VERSION,
    CalibrationError,
    CalibrationInfo,
    CostModels,
    FitError,
    LinkCost,
)
from kvstore.blocks import Tier


def to_json(models: CostModels) -> dict[str, Any]:
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "info": dataclasses.asdict(models.info),
        "kv_bytes_per_token": models.kv_bytes_per_token,
        "snapshot_bytes": models.snapshot_bytes,
        "coefficients": {name: getattr(models, name) for name in COEFFICIENTS},
        "links": {name: dataclasses.asdict(cost) for name, cost in models.links.items()},
        "tier_reads": {tier.name: dataclasses.asdict(cost) for tier, cost in models.tier_reads.items()},
        "fit_errors": {name: dataclasses.asdict(err) for name, err in models.fit_errors.items()},
    }


def save_models(models: CostModels, path: str | Path) -> None:
    """Writes the versioned JSON form atomically (temp file + rename); creates parent dirs."""
    path = Path(path)
    text = json.dumps(to_json(models), indent=2, allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # readers see the old file or the whole new one


def load_models(path: str | Path, *, model_fingerprint: str | None = None, device: str | None = None,
                threads: int | None = None) -> CostModels:
    """Reads a file ``save_models`` wrote; CalibrationError naming the path for a missing or
    corrupt file, a wrong format/version, a bad field, or (when given) another model
    fingerprint, device or thread count."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CalibrationError(f"{path}: no calibration file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrationError(f"{path}: cannot read calibration file ({e})") from e
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{path}: not valid JSON ({e}); delete it to recalibrate") from e
    models = from_json(raw, path)
    info = models.info
    for what, want, got in (("model_fingerprint", model_fingerprint, info.model_fingerprint),
                            ("device", device, info.device), ("torch_threads", threads, info.torch_threads)):
        if want is not None and want != got:
            raise CalibrationError(f"{path}: calibrated for {what} {got!r}, expected {want!r}")
    return models


def from_json(raw: Any, path: Path) -> CostModels:
    r = _Reader(path)
    top = r.mapping(raw, "the file")
    if top.get("format") != FORMAT_NAME:
        raise CalibrationError(f"{path}: format is {top.get('format')!r}, expected {FORMAT_NAME!r}")
    if top.get("version") != FORMAT_VERSION:
        raise CalibrationError(f"{path}: version {top.get('version')!r}, this build reads version {FORMAT_VERSION}")
    coefs = r.mapping(r.get(top, "coefficients", ""), "coefficients")
    try:
        return CostModels(
            kv_bytes_per_token=r.integer(top, "kv_bytes_per_token", ""),
            snapshot_bytes=r.integer(top, "snapshot_bytes", ""),
            **{name: r.number(coefs, name, "coefficients.") for name in COEFFICIENTS},
            links={name: r.link(cost, f"links.{name}") for name, cost in r.mapping_at(top, "links").items()},
            tier_reads={r.tier(name): r.link(cost, f"tier_reads.{name}")
                        for name, cost in r.mapping_at(top, "tier_reads").items()},
            fit_errors={name: r.fit_error(err, f"fit_errors.{name}")
                        for name, err in r.mapping_at(top, "fit_errors").items()},
            info=r.info(r.get(top, "info", "")),
        )
    except ValueError as e:
        if isinstance(e, CalibrationError):
            raise
        raise CalibrationError(f"{path}: {e}") from e


class _Reader:
    """Typed field access that raises CalibrationError naming the path and the field."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, message: str) -> CalibrationError:
        return CalibrationError(f"{self.path}: {message}")

    def get(self, obj: dict, key: str, where: str) -> Any:
        if key not in obj:
            raise self.fail(f"missing field {where}{key}")
        return obj[key]

    def mapping(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            raise self.fail(f"{where} must be a JSON object, got {type(value).__name__}")
        return value

    def mapping_at(self, obj: dict, key: str) -> dict:
        return self.mapping(self.get(obj, key, ""), key)

    def number(self, obj: dict, key: str, where: str) -> float:
        value = self.get(obj, key, where)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"{where}{key} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise self.fail(f"{where}{key} must be finite and >= 0, got {value!r}")
        return float(value)

    def integer(self, obj: dict, key: str, where: str) -> int:
        value = self.get(obj, key, where)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(f"{where}{key} must be an integer >= 0, got {value!r}")
        return value

    def text(self, obj: dict, key: str, where: str) -> str:
        value = self.get(obj, key, where)
        if not isinstance(value, str):
            raise self.fail(f"{where}{key} must be a string, got {value!r}")
        return value

    def tier(self, name: str) -> Tier:
        if name not in Tier.__members__:
            raise self.fail(f"tier_reads: unknown tier {name!r}; tiers are {list(Tier.__members__)}")
        return Tier[name]

    def link(self, value: Any, where: str) -> LinkCost:
        obj = self.mapping(value, where)
        return LinkCost(self.number(obj, "latency_s", f"{where}."), self.number(obj, "s_per_byte", f"{where}."))

    def fit_error(self, value: Any, where: str) -> FitError:
        obj = self.mapping(value, where)
        return FitError(self.number(obj, "median_rel_err", f"{where}."), self.number(obj, "max_rel_err", f"{where}."),
                        self.integer(obj, "num_fit", f"{where}."), self.integer(obj, "num_held_out", f"{where}."))

    def info(self, value: Any) -> CalibrationInfo:
        obj = self.mapping(value, "info")
        kinds = {f.name: f.type for f in dataclasses.fields(CalibrationInfo)}
        values: dict[str, Any] = {}
        for name, kind in kinds.items():
            if kind == "str":
                values[name] = self.text(obj, name, "info.")
            elif kind == "int":
                values[name] = self.integer(obj, name, "info.")
            else:
                values[name] = self.number(obj, name, "info.")
        return CalibrationInfo(**values)
