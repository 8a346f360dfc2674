"""A checkpoint's ``quantization_config``, read with compressed-tensors: which linear is stored how.

Owns the one decision "is module M quantized, and in which format": the config groups'
``targets`` and the ``ignore`` list (exact names and ``re:`` patterns, matched by
compressed-tensors' own ``match_name``; the class target ``Linear`` matches every linear), and
the check that a group's scheme is one Tidekv computes:

    pack-quantized        INT4 as K2-Thinking ships it: int, 4 bits, symmetric, group strategy
    mxfp4-pack-quantized  OCP MXFP4: float (e2m1), 4 bits, group 32, e8m0 scale

Both are weight-only: a group that also quantizes activations is refused. compressed-tensors
(and transformers, which it imports) is imported only when a checkpoint carries a
quantization_config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.checkpoint import CheckpointError

INT4 = "pack-quantized"
MXFP4 = "mxfp4-pack-quantized"
SUPPORTED_FORMATS = (INT4, MXFP4)
LINEAR_CLASS = "Linear"  # the class target: every quantizable linear of the model


@dataclass(frozen=True)
class LinearScheme:
    """How one linear's weight is stored."""

    format: str  # INT4 or MXFP4
    group_size: int  # input values per scale
    group_name: str  # the config_groups key, for messages


@dataclass(frozen=True)
class QuantConfig:
    """The parsed ``quantization_config`` of one checkpoint (``source``: its config.json)."""

    groups: tuple[tuple[str, Any], ...]  # (group name, compressed_tensors QuantizationScheme), in order
    ignore: tuple[str, ...]
    model_format: str  # the config's top-level ``format``
    source: str

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str) -> QuantConfig:
        from compressed_tensors.quantization import QuantizationConfig
        from pydantic import ValidationError

        method = raw.get("quant_method")
        if method != "compressed-tensors":
            raise CheckpointError(f"{source}: quantization_config.quant_method {method!r} is not supported "
                                  f"(Tidekv reads 'compressed-tensors' checkpoints: {', '.join(SUPPORTED_FORMATS)})")
        try:
            parsed = QuantizationConfig.model_validate(raw)
        except ValidationError as e:
            raise CheckpointError(f"{source}: quantization_config is not a valid compressed-tensors config "
                                  f"({_first_error(e)})") from e
        return cls(tuple(parsed.config_groups.items()), tuple(parsed.ignore or ()), str(parsed.format), source)

    def scheme_for(self, module: str, where: str) -> LinearScheme | None:
        """The scheme of linear ``module`` (e.g. ``model.layers.1.mlp.experts.0.gate_proj``), or
        None when it is stored dense. ``where`` names the tensor and file for errors."""
        from compressed_tensors.utils.match import match_name

        def matches(target: str) -> bool:
            return target == LINEAR_CLASS or match_name(module, target)

        if any(matches(t) for t in self.ignore):
            return None
        for name, scheme in self.groups:
            if any(matches(t) for t in scheme.targets):
                return self._checked(name, scheme, where)
        return None

    def _checked(self, name: str, scheme: Any, where: str) -> LinearScheme:
        group = f"{self.source}: quantization_config.config_groups.{name}"
        fmt = str(getattr(scheme.format, "value", scheme.format) or self.model_format)
        if fmt not in SUPPORTED_FORMATS:
            raise CheckpointError(f"{where}: quantization format {fmt!r} ({group}) is not supported; "
                                  f"Tidekv computes {' and '.join(SUPPORTED_FORMATS)}")
        if scheme.input_activations is not None or scheme.output_activations is not None:
            raise CheckpointError(f"{where}: {group} quantizes activations; Tidekv computes weight-only "
                                  f"{fmt} (input_activations and output_activations must be null)")
        w = scheme.weights
        if w is None:
            raise CheckpointError(f"{where}: {group} has no weights scheme")
        want_type = "int" if fmt == INT4 else "float"
        problems = [f"{key}={got!r} (needs {need!r})" for key, got, need in (
            ("num_bits", w.num_bits, 4), ("type", str(w.type), want_type), ("symmetric", w.symmetric, True),
            ("strategy", str(w.strategy), "group"), ("actorder", w.actorder, None),
        ) if got != need]
        if fmt == MXFP4 and w.group_size != 32:
            problems.append(f"group_size={w.group_size} (MXFP4 blocks are 32 values)")
        if problems:
            raise CheckpointError(f"{where}: {group} weights {', '.join(problems)}; not a {fmt} scheme Tidekv computes")
        return LinearScheme(fmt, int(w.group_size), name)


def load_quant_config(directory: str | Path) -> QuantConfig | None:
    """The quantization_config of ``directory/config.json``; None for a full-precision checkpoint."""
    path = Path(directory) / "config.json"
    raw = json.loads(path.read_text()).get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: quantization_config must be an object, got {type(raw).__name__}")
    return QuantConfig.from_dict(raw, str(path))


def _first_error(e: Any) -> str:
    """The first pydantic error as ``key.path: message, got value`` (validator frames left out)."""
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if not str(p).startswith("function-"))
    got = f", got {err['input']!r}" if isinstance(err.get("input"), str | int | float) else ""
    return f"{loc}: {err.get('msg')}{got}" if loc else f"{err.get('msg')}{got}"
