"""What a live cluster adds to the calibrated engine times, as a frozen value the simulator
applies, and the JSON file it is kept in.

``tidekv calibrate`` times the engine alone, on a quiet process. A live request also pays
for the processes around it, and the simulator models those costs with this value
(``replay.sim``); the Conductor's policies keep predicting from the calibration alone, as
the live Conductor does. Where each term lies in a request's life::

    arrival ─ dispatch_s ─► prefill queue ─► worker time ─► first_token_delay_s ─► first token ─ decode join ─► batch

    dispatch_s: the route, the Reserve and Prefill RPCs;
    worker time: prefill_coefficients (the calibration's formula, refitted on the live
      worker: the KV push, the decode worker's verdict, the store, the cores it shares), plus
      reuse_load_s_per_token for each reused token copied into pages rather than reused in
      place, the two times a ratio drawn from prefill_ratio_quantiles (the live prefills'
      spread around the fit, mean 1); at its start the worker pushes its reused rows to the
      decode worker, whose loop pauses decode_stall_s_per_reused_token per row;
    first_token_delay_s: the Prefill response, the Conductor and the client's stream;
    decode join: a delay drawn from decode_join_quantiles_s (the Decode RPC, the KV
      verified, a step boundary);
    every decode step: decode_step_scale * decode_step_s(batch, context);
    every token after the first: reaches the client delivery_delay_s later (two streamed
      hops, decode worker -> Conductor -> client, each a Python process sharing the cores);
      a stream is in order, so a token never overtakes the one before it.

The decode loop also loses time to the work other requests cause around it, there and then
(the step in progress ends that much later), because on one host (``tidekv up``) every
process shares the same cores and the decode worker's handlers share its interpreter:

- ``decode_stall_s_per_prefill``, on the request's decode worker when its prefill ends: the
  Conductor takes the Prefill response (the first token to the client, the index events)
  and calls Decode, and the decode worker gives its verdict on the pushed KV and takes the
  Decode call. It stretches the step in progress; an idle loop loses nothing, its
  next step being that request's own, after its join;
- ``decode_stall_s_per_arrival``, on every decode worker when a request arrives: the client
  builds and sends it, the Conductor parses, validates (every prompt token id) and admits it
  (a fit on a cluster whose Conductor and clients have cores of their own finds about 0).

``ClusterOverheads()`` (``NO_OVERHEADS``) adds nothing: the simulator is then the calibrated
engine alone. The values come from a live replay (``replay.sim.fit.fit_overheads``), fitted
on one window of requests and checked on another (``bench/fidelity.py``). Pure, no numpy.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from costmodel.model import PREFILL_TERMS, CostModels

FORMAT_NAME = "tidekv-overheads"
FORMAT_VERSION = 1
_SECONDS = ("dispatch_s", "reuse_load_s_per_token", "first_token_delay_s", "decode_stall_s_per_reused_token",
            "decode_stall_s_per_prefill", "decode_stall_s_per_arrival")
_QUANTILES = ("decode_join_quantiles_s", "delivery_delay_quantiles_s", "prefill_ratio_quantiles")


@dataclass(frozen=True)
class ClusterOverheads:
    """See the module docstring for where each term applies. Seconds; ``decode_step_scale`` is a
    factor on the calibrated step. ``prefill_coefficients``: the live worker's prefill time in
    ``CostModels.prefill_s``'s formula, in ``PREFILL_TERMS`` order (empty: the calibration's);
    ``reuse_load_s_per_token``: what a reused token copied into pages (from DRAM, SSD or a
    pull) costs beyond one reused in place, on the device tier (its payload copied and
    checked); ``first_token_delay_s``: from the worker's end of a prefill to its first token
    at the client.
    ``decode_join_quantiles_s``, ``delivery_delay_quantiles_s``: those delays' quantiles at
    evenly spaced probabilities ``(i + 0.5) / len`` (``quantile``; empty: no delay; one value:
    always that delay); ``prefill_ratio_quantiles``: the same of a prefill's live time over
    ``worker_prefill_s`` (empty: always 1). ``source``: how the values were obtained (a fit names
    the report and the requests it used); ``num_fit_requests``: how many."""

    dispatch_s: float = 0.0
    prefill_coefficients: tuple[float, ...] = ()
    reuse_load_s_per_token: float = 0.0
    first_token_delay_s: float = 0.0
    decode_join_quantiles_s: tuple[float, ...] = ()
    decode_step_scale: float = 1.0
    decode_stall_s_per_reused_token: float = 0.0
    decode_stall_s_per_prefill: float = 0.0
    decode_stall_s_per_arrival: float = 0.0
    delivery_delay_quantiles_s: tuple[float, ...] = ()
    prefill_ratio_quantiles: tuple[float, ...] = ()
    source: str = "none"
    num_fit_requests: int = 0

    def __post_init__(self) -> None:
        for name in ("prefill_coefficients", *_QUANTILES):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
        for name in (*_SECONDS, "decode_step_scale"):
            value = float(getattr(self, name))
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
            object.__setattr__(self, name, value)
        if self.decode_step_scale <= 0:
            raise ValueError(f"decode_step_scale must be > 0, got {self.decode_step_scale}")
        c = self.prefill_coefficients
        if c and (len(c) != len(PREFILL_TERMS) or not all(math.isfinite(x) and x >= 0 for x in c)):
            raise ValueError(f"prefill_coefficients must be {len(PREFILL_TERMS)} finite values >= 0 "
                             f"({', '.join(PREFILL_TERMS)}), got {c}")
        for name in _QUANTILES:
            q = getattr(self, name)
            if any(not (math.isfinite(x) and x >= 0) for x in q) or any(b < a for a, b in zip(q, q[1:], strict=False)):
                raise ValueError(f"{name} must be finite, >= 0 and non-decreasing, got {q}")

    def live_prefill(self, costs: CostModels) -> CostModels:
        """``costs`` with the live worker's prefill coefficients (``costs`` itself when none)."""
        if not self.prefill_coefficients:
            return costs
        return dataclasses.replace(costs, **dict(zip(PREFILL_TERMS, self.prefill_coefficients, strict=True)))

    def worker_prefill_s(self, live: CostModels, num_new: int, num_reused: int, num_loaded: int) -> float:
        """A prefill's time on the live worker; ``live`` is ``live_prefill(costs)``, made once
        by the caller. ``num_loaded`` of the reused tokens were copied in, not reused in place."""
        return live.prefill_s(num_new, num_reused) + self.reuse_load_s_per_token * num_loaded

    def prefill_ratio(self, u: float) -> float:
        """The live worker's time over ``worker_prefill_s`` at probability ``u`` in [0, 1)
        (``quantile``; 1 when none is known)."""
        return quantile(self.prefill_ratio_quantiles, u) if self.prefill_ratio_quantiles else 1.0

    def decode_step_s(self, calibrated_s: float) -> float:
        return self.decode_step_scale * calibrated_s

    def decode_join_s(self, u: float) -> float:
        """The join delay at probability ``u`` in [0, 1) (see ``quantile``)."""
        return quantile(self.decode_join_quantiles_s, u)

    def delivery_delay_s(self, u: float) -> float:
        """The delivery delay at probability ``u`` in [0, 1) (see ``quantile``)."""
        return quantile(self.delivery_delay_quantiles_s, u)

    def describe(self) -> dict:
        return dataclasses.asdict(self) | {name: list(getattr(self, name))
                                           for name in ("prefill_coefficients", *_QUANTILES)}

    # ---- the file ---------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Versioned JSON, written atomically (temp file + rename); creates parent dirs."""
        path = Path(path)
        text = json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, **self.describe()}, indent=2) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> ClusterOverheads:
        """Reads a file written by ``save``; ValueError naming the path for any defect."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot read an overheads file ({e})") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME or raw.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: not a {FORMAT_NAME} file of version {FORMAT_VERSION}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known - {"format", "version"}
        if unknown:
            raise ValueError(f"{path}: unknown fields {sorted(unknown)}")
        try:
            return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if k in known})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from e


NO_OVERHEADS = ClusterOverheads()  # the calibrated engine alone


def quantile(q: tuple[float, ...], u: float) -> float:
    """The value at probability ``u`` in [0, 1) of a distribution stored as quantiles at
    ``(i + 0.5) / len(q)``: linear between them, flat beyond the outermost (0 for none)."""
    if not q:
        return 0.0
    pos = u * len(q) - 0.5  # quantile i sits at position i
    if pos <= 0:
        return q[0]
    i = int(pos)
    if i >= len(q) - 1:
        return q[-1]
    return q[i] + (pos - i) * (q[i + 1] - q[i])
