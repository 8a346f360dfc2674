"""Tidekv's cost models: predicted prefill, decode-step and transfer times, fitted from
measurements of the real engine and transfer engine (``tidekv calibrate``) and saved as a
versioned JSON file per (model fingerprint, device, torch threads).

Public API: ``CostModels`` (predictions, ``analytic``), ``save_models``/``load_models``, ``CalibrationError``,
``default_calibration_path``, ``LinkCost``, ``FitError``, ``CalibrationInfo``; and, loaded on
first use because they import torch and the engine, ``calibrate`` and ``ensure_calibration``
(``costmodel.calibrate``). Importing the package itself loads neither torch nor numpy.
"""

from costmodel.model import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CalibrationError,
    CalibrationInfo,
    CostModels,
    FitError,
    LinkCost,
    default_calibration_path,
)
from costmodel.storage import load_models, save_models

_LAZY = {"calibrate": "costmodel.calibrate", "ensure_calibration": "costmodel.calibrate"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "CalibrationError", "CalibrationInfo", "CostModels", "FitError", "LinkCost",
    "calibrate", "default_calibration_path", "ensure_calibration", "load_models", "save_models",
]
