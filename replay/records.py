"""The per-request record of a replay, shared by the live replay and the simulator.

One ``RequestRecord`` per replayed request, whatever its end; ``requests.jsonl`` holds one
JSON object per record. Nothing here knows gRPC: the live replay fills records from the
stream, the simulator from its events (``source="simulated"``).

Times (seconds)::

    replay clock 0 ......... scheduled_s ... arrival_s ......................................
    request clock                              0 -- queue_s -- ttft_s ... token_times_s ... latency_s
                                               (sent)  (prefill starts) (first token)     (terminal)

``scheduled_s`` and ``arrival_s`` are on the replay clock (0 = replay start); every other time
is relative to the request's own ``arrival_s``. ``token_times_s[i]`` is when output token ``i``
arrived (tokens of one stream message share its time), so ``token_times_s[0] == ttft_s``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

import orjson

SCHEMA_VERSION = 1

FINISHED, REJECTED, FAILED, CANCELLED = "finished", "rejected", "failed", "cancelled"
OUTCOMES = (FINISHED, REJECTED, FAILED, CANCELLED)
SOURCES = ("live", "simulated")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request. ``outcome`` is one of ``OUTCOMES``; ``finish_reason`` is
    ``stop``/``length`` for finished ones; ``status`` is the gRPC status name (``OK`` when the
    stream ended normally). Worker ids are empty when no worker was chosen."""

    request_id: str
    index: int
    source: str
    outcome: str
    scheduled_s: float
    arrival_s: float
    prompt_len: int
    max_tokens: int
    status: str = "OK"
    finish_reason: str = ""
    error: str = ""
    retry_after_s: float | None = None
    server_request_id: str = ""
    tenant: str = ""
    ttft_s: float | None = None
    latency_s: float | None = None
    queue_s: float | None = None
    token_times_s: tuple[float, ...] = field(default=())
    prompt_tokens: int = 0  # as the server counted them (usage.prompt_tokens)
    cached_tokens: int = 0
    loaded_cached_tokens: int = 0  # of cached_tokens, those copied in (DRAM, SSD, a pull), not reused in place
    prefill_worker_s: float | None = None  # the prefill as its worker timed it (None: not reported)
    prefill_worker: str = ""
    decode_worker: str = ""
    route_branch: str = ""
    pulled_from: str = ""
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {self.outcome!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def end_s(self) -> float:
        """Replay-clock time of the request's end (its arrival when nothing was measured)."""
        return self.arrival_s + (self.latency_s or 0.0)

    def to_dict(self) -> dict[str, Any]:
        """The fields by name, in declaration order (``token_times_s`` stays a tuple: no copies)."""
        return {name: getattr(self, name) for name in _FIELD_NAMES}

    def to_json(self) -> str:
        """The record as one compact JSON line. orjson writes it (about 7x faster than json on
        the token times, most of a long run's output), but json does when orjson would write
        another value: a float that is not finite (json: ``NaN``/``Infinity``, orjson: ``null``)
        or an integer past 64 bits (orjson refuses it). Both write the shortest digits that read
        back as the same float, so a line reads back the same; only how a float far from 1 is
        spelt may differ (``1e-05`` / ``0.00001``)."""
        d = self.to_dict()
        total = sum(self.token_times_s)  # NaN or an infinity anywhere makes the sum not finite
        for name in _FLOAT_FIELDS:
            value = d[name]
            if value is not None:
                total += value
        if math.isfinite(total):
            try:
                return orjson.dumps(d).decode()
            except orjson.JSONEncodeError:
                pass
        return _ENCODER.encode(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        kw = {k: v for k, v in d.items() if k in _FIELD_SET}
        kw["token_times_s"] = tuple(kw.get("token_times_s", ()))
        return cls(**kw)


_FIELD_NAMES = tuple(f.name for f in fields(RequestRecord))
_FIELD_SET = frozenset(_FIELD_NAMES)
_ENCODER = json.JSONEncoder(separators=(",", ":"))
_FLOAT_FIELDS = tuple(f.name for f in fields(RequestRecord) if "float" in str(f.type) and f.name != "token_times_s")


def write_records(path, records: list[RequestRecord] | tuple[RequestRecord, ...]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(r.to_json() + "\n")


def read_records(path) -> list[RequestRecord]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(RequestRecord.from_dict(json.loads(line)))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a request record: {e}") from None
    return out
