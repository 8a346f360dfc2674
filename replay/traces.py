"""Trace files: the ``TraceRequest`` value and readers/writers for the formats Tidekv replays.

Owns parsing and validation only; selection, scaling and token materialisation live in
``replay.transform`` and ``replay.tokens``. Every bad line raises ``ValueError`` naming the
file, the line number and the field.

Formats
-------
``mooncake`` (JSONL, kvcache-ai/Mooncake FAST'25 release), one object per line::

    {"timestamp": ms since start, "input_length": tokens, "output_length": tokens,
     "hash_ids": [ids of 512-token blocks, prefix-chained]}

Other keys are ignored. ``len(hash_ids)`` must cover the prompt:
``>= ceil(input_length / trace_block_tokens)``.

``jsonl`` (generic), one object per line; unknown keys are an error (a typo must not pass
silently):

    ``arrival_s``      float >= 0, required: arrival time in seconds from the trace start
    ``output_length``  int >= 0, required: tokens to generate (scaled and clamped to >= 1 later)
    ``prompt_token_ids`` list of ints: the exact prompt, used as given; OR
    ``input_length`` + ``hash_ids``: a length and prefix-group ids, each id standing for one
                       block of ``trace_block_tokens`` tokens exactly as in the Mooncake format
    ``tenant``         str, optional
    ``request_id``     str, optional
    ``ttft_slo_s``, ``tbt_slo_s``  float > 0, optional per-request SLOs

``csv`` (generic): a header row with the same column names; ``prompt_token_ids`` and
``hash_ids`` hold space-separated integers; an empty cell means the field is absent.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = ("mooncake", "jsonl", "csv")
MOONCAKE_BLOCK_TOKENS = 512
# Mooncake's FAST'25 synthetic trace, shipped in the checkout with its license (data/traces/).
SYNTHETIC_TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "synthetic_trace.jsonl"
GENERIC_FIELDS = ("arrival_s", "output_length", "prompt_token_ids", "input_length", "hash_ids", "tenant",
                  "request_id", "ttft_slo_s", "tbt_slo_s")


@dataclass(frozen=True)
class TraceRequest:
    """One request as the trace states it, before any scaling. Lengths are in trace tokens.

    ``hash_ids`` are prefix-chained ids of ``Trace.block_tokens``-token blocks; ``prompt_ids``
    (generic format only) replaces them with an exact prompt, and then ``input_len`` equals
    ``len(prompt_ids)``."""

    index: int  # 0-based position in the file, stable across selections
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()
    prompt_ids: tuple[int, ...] | None = None
    tenant: str = ""
    request_id: str = ""
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None


@dataclass(frozen=True)
class Trace:
    """A whole trace file: its requests in file order and the block length of its hash ids."""

    requests: tuple[TraceRequest, ...]
    format: str
    source: str = ""
    block_tokens: int = MOONCAKE_BLOCK_TOKENS


class _Line:
    """Field accessors for one parsed line; each failure names the line and the field."""

    def __init__(self, where: str, obj: dict[str, Any]):
        self.where, self.obj = where, obj

    def fail(self, name: str, what: str) -> ValueError:
        return ValueError(f"{self.where}: field {name!r}: {what}, got {self.obj.get(name)!r}")

    def has(self, name: str) -> bool:
        return self.obj.get(name) is not None

    def number(self, name: str, *, positive: bool = False) -> float:
        v = self.obj.get(name)
        if v is None:
            raise ValueError(f"{self.where}: field {name!r} is missing")
        try:
            x = float(v) if isinstance(v, str) else v
        except ValueError:
            raise self.fail(name, "expected a number") from None
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise self.fail(name, "expected a finite number")
        if x < 0 or (positive and x == 0):
            raise self.fail(name, "expected a positive number" if positive else "expected a number >= 0")
        return float(x)

    def count(self, name: str, *, minimum: int = 0) -> int:
        v = self.obj.get(name)
        if v is None:
            raise ValueError(f"{self.where}: field {name!r} is missing")
        if isinstance(v, str):
            v = int(v) if v.strip().lstrip("-").isdigit() else v
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.fail(name, f"expected an integer >= {minimum}")
        return v

    def ids(self, name: str) -> tuple[int, ...]:
        v = self.obj.get(name)
        if isinstance(v, str):  # CSV cell
            parts = v.split()
            if not all(p.isdigit() for p in parts):
                raise self.fail(name, "expected space-separated integers >= 0")
            return tuple(int(p) for p in parts)
        if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v):
            raise self.fail(name, "expected a list of integers >= 0")
        return tuple(v)

    def text(self, name: str) -> str:
        v = self.obj.get(name, "")
        if v is None:
            return ""
        if not isinstance(v, str):
            raise self.fail(name, "expected a string")
        return v

    def optional_slo(self, name: str) -> float | None:
        return self.number(name, positive=True) if self.has(name) else None


def _check_chain(line: _Line, input_len: int, hash_ids: tuple[int, ...], block_tokens: int) -> None:
    need = math.ceil(input_len / block_tokens)
    if len(hash_ids) < need:
        raise line.fail("hash_ids", f"{len(hash_ids)} ids cannot cover input_length {input_len} "
                                    f"(need ceil({input_len}/{block_tokens}) = {need})")


def _mooncake(line: _Line, index: int, block_tokens: int) -> TraceRequest:
    input_len = line.count("input_length", minimum=1)
    hash_ids = line.ids("hash_ids")
    _check_chain(line, input_len, hash_ids, block_tokens)
    return TraceRequest(index=index, arrival_s=line.number("timestamp") / 1000.0, input_len=input_len,
                        output_len=line.count("output_length"), hash_ids=hash_ids)


def _generic(line: _Line, index: int, block_tokens: int) -> TraceRequest:
    unknown = sorted(k for k in line.obj if k not in GENERIC_FIELDS)
    if unknown:
        raise ValueError(f"{line.where}: unknown field(s) {unknown}; known: {list(GENERIC_FIELDS)}")
    prompt_ids, hash_ids = None, ()
    if line.has("prompt_token_ids"):
        if line.has("hash_ids") or line.has("input_length"):
            raise ValueError(f"{line.where}: give prompt_token_ids OR input_length + hash_ids, not both")
        prompt_ids = line.ids("prompt_token_ids")
        if not prompt_ids:
            raise line.fail("prompt_token_ids", "expected a non-empty list")
        input_len = len(prompt_ids)
    else:
        if not line.has("input_length"):
            raise ValueError(f"{line.where}: field 'input_length' is missing (or give prompt_token_ids)")
        input_len = line.count("input_length", minimum=1)
        if not line.has("hash_ids"):
            raise ValueError(f"{line.where}: field 'hash_ids' is missing (prefix-group ids for input_length)")
        hash_ids = line.ids("hash_ids")
        _check_chain(line, input_len, hash_ids, block_tokens)
    return TraceRequest(index=index, arrival_s=line.number("arrival_s"), input_len=input_len,
                        output_len=line.count("output_length"), hash_ids=hash_ids, prompt_ids=prompt_ids,
                        tenant=line.text("tenant"), request_id=line.text("request_id"),
                        ttft_slo_s=line.optional_slo("ttft_slo_s"), tbt_slo_s=line.optional_slo("tbt_slo_s"))


def _json_lines(path: Path) -> Iterator[_Line]:
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield _Line(where, obj)


def _csv_lines(path: Path) -> Iterator[_Line]:
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:
            return
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row:
                raise ValueError(f"{where}: more cells than header columns")
            yield _Line(where, {k: v for k, v in row.items() if v not in ("", None)})


def read_trace(path: str | Path, format: str = "mooncake", *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """Reads a whole trace file. ``block_tokens`` is the token length of one hash id (512 for
    Mooncake traces). Raises ValueError naming the line and field of the first bad line."""
    if format not in FORMATS:
        raise ValueError(f"trace format must be one of {FORMATS}, got {format!r}")
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    path = Path(path)
    lines = _csv_lines(path) if format == "csv" else _json_lines(path)
    parse = _mooncake if format == "mooncake" else _generic
    requests = tuple(parse(line, i, block_tokens) for i, line in enumerate(lines))
    if not requests:
        raise ValueError(f"{path}: the trace holds no requests")
    return Trace(requests=requests, format=format, source=str(path), block_tokens=block_tokens)


def _generic_obj(r: TraceRequest) -> dict[str, Any]:
    obj: dict[str, Any] = {"arrival_s": r.arrival_s, "output_length": r.output_len}
    if r.prompt_ids is not None:
        obj["prompt_token_ids"] = list(r.prompt_ids)
    else:
        obj["input_length"], obj["hash_ids"] = r.input_len, list(r.hash_ids)
    for name in ("tenant", "request_id", "ttft_slo_s", "tbt_slo_s"):
        if getattr(r, name) not in (None, ""):
            obj[name] = getattr(r, name)
    return obj


def write_trace(path: str | Path, requests: tuple[TraceRequest, ...] | list[TraceRequest], format: str) -> None:
    """Writes requests in a generic format (``jsonl`` or ``csv``) that ``read_trace`` reads back
    to equal values (indices are positions in the written file)."""
    if format == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for r in requests:
                f.write(json.dumps(_generic_obj(r)) + "\n")
        return
    if format != "csv":
        raise ValueError(f"write_trace writes 'jsonl' or 'csv', got {format!r}")
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(GENERIC_FIELDS))
        writer.writeheader()
        for r in requests:
            obj = _generic_obj(r)
            for name in ("prompt_token_ids", "hash_ids"):
                if name in obj:
                    obj[name] = " ".join(map(str, obj[name]))
            writer.writerow({k: ("" if v is None else (repr(v) if isinstance(v, float) else v))
                             for k, v in obj.items()})
