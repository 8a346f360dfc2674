"""The one place that reads environment variables (all prefixed ``TIDEKV_``) and turns argv
plus environment into a component's frozen config.

A component's config is a frozen dataclass whose fields all have defaults (written once,
there). ``parse_config(Config, argv, env)`` makes one ``--flag-name`` per field, takes each
default from ``TIDEKV_FLAG_NAME`` when that variable is set (so a Kubernetes ConfigMap or a
shell can configure any role), and lets argv override both:

    field ``max_running: int = 16``  ->  flag ``--max-running``, variable ``TIDEKV_MAX_RUNNING``

Field metadata ``{"help": ...}`` becomes the flag's help; ``{"choices": fn}`` (a callable, so
registries load lazily) restricts the value. Bools take ``--flag`` / ``--no-flag`` and the
variable values 1/0, true/false, yes/no; tuples of strings take a comma-separated value.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

C = TypeVar("C")
ENV_PREFIX = "TIDEKV_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def torch_threads() -> int:
    """Threads each process gives torch: TIDEKV_TORCH_THREADS, default 1 (servers share 2 cores)."""
    return int(os.environ.get("TIDEKV_TORCH_THREADS", "1"))


def setup_torch(threads: int | None = None) -> None:
    """A serving process's engine settings: torch's threads, denormals flushed, and the C heap
    kept once grown (``runtime.allocator``: no page faults on every chunk's temporaries)."""
    import torch  # here, not at the top: the simulator's command line parses settings without torch

    from runtime.allocator import keep_heap

    torch.set_num_threads(threads or torch_threads())
    torch.set_flush_denormal(True)
    keep_heap()


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _parse_bool(name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{name}={text!r}: expected one of {_TRUE + _FALSE}")


def _field_type(cls: type, field: dataclasses.Field) -> Any:
    hints = typing.get_type_hints(cls)
    return hints[field.name]


def _convert(name: str, kind: Any, text: str) -> Any:
    """``text`` (from the environment) as a value of the field's type; ValueError naming it."""
    origin = typing.get_origin(kind)
    try:
        if kind is bool:
            return _parse_bool(name, text)
        if origin is tuple:
            return tuple(part.strip() for part in text.split(",") if part.strip())
        if kind in (int, float, str):
            return kind(text)
    except ValueError as e:
        raise ValueError(f"{name}={text!r}: {e}") from e
    raise TypeError(f"config field {name}: unsupported type {kind}")


def _add_flag(parser: argparse.ArgumentParser, cls: type, field: dataclasses.Field, env: Mapping[str, str]) -> None:
    kind = _field_type(cls, field)
    flag = "--" + field.name.replace("_", "-")
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
    var = env_name(field.name)
    if var in env:
        default = _convert(var, kind, env[var])
    help_text = field.metadata.get("help", "")
    help_text = f"{help_text} (env {var}; default %(default)s)".strip()
    if kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        return
    choices_fn = field.metadata.get("choices")
    choices = list(choices_fn()) if choices_fn else None
    if choices is not None and var in env and default not in choices:  # argparse checks argv only
        raise ValueError(f"{var}={env[var]!r}: invalid choice (choose from {', '.join(map(str, choices))})")
    if typing.get_origin(kind) is tuple:
        parser.add_argument(flag, type=lambda t: _convert(flag, kind, t), default=default, help=help_text)
        return
    if isinstance(kind, types.UnionType):
        raise TypeError(f"config field {field.name}: optional fields are not supported; use a sentinel default")
    parser.add_argument(flag, type=kind, default=default, choices=choices, help=help_text)


def config_parser(cls: type, prog: str, env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of the dataclass ``cls``."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog)
    for field in dataclasses.fields(cls):
        if field.init:
            _add_flag(parser, cls, field, env)
    return parser


def parse_config(cls: type[C], argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                 prog: str = "tidekv") -> C:
    """The frozen config ``cls`` from ``argv`` over ``TIDEKV_*`` in ``env`` over the defaults.

    Bad values exit like argparse does (status 2, a message naming the flag); a value the
    config itself refuses (its ``__post_init__``) raises ``ValueError`` with its message."""
    try:
        parser = config_parser(cls, prog, env)
    except ValueError as e:  # an environment value that does not parse: exit as argparse does
        argparse.ArgumentParser(prog).error(str(e))
    args = parser.parse_args(list(argv or []))
    return cls(**vars(args))


def argv_of(config: Any, only_changed: bool = True) -> list[str]:
    """Flags that reproduce ``config`` (those that differ from the defaults, by default)."""
    defaults = type(config)()
    out: list[str] = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if only_changed and value == getattr(defaults, field.name):
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            out += [flag, ",".join(value)]
        else:
            out += [flag, str(value)]
    return out
