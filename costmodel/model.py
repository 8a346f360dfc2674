"""The cost models as a frozen value: the formulas that predict prefill, decode-step and
transfer times from fitted (or hand-set) coefficients, and the file each calibration lives in.

Owns the prediction arithmetic only; fitting is in ``costmodel.fit``, measuring in
``costmodel.measure_engine`` / ``costmodel.measure_transfer``, the JSON form in
``costmodel.storage``. Importing this module loads neither torch nor numpy, so a Conductor
or simulator can use it cheaply. Every method is pure and thread-safe; times are seconds.

Formulas (n = new tokens, p = reused tokens, b = batch size, c = context tokens of the batch)::

    prefill_s(n, p)     = const + n*s_per_token + n*p*s_per_token_x_reused + n*n*s_per_token_sq
                          + p*reuse_s_per_token
    decode_step_s(b, c) = decode_base_s + b*decode_s_per_request + c*decode_s_per_context_token
                          (0 when b == 0)
    transfer_s(B, backend, tier) = read_s(B, tier) + link_s(B, backend)
        read_s(B, tier)     = tier_reads[tier].time_s(B)   (0 when no tier read cost is known)
        link_s(B, backend)  = links[backend].time_s(B)      (ucx falls back to tcp's fit)
    LinkCost.time_s(B)  = latency_s + B*s_per_byte        (0 when B == 0: nothing to move)

Why n*p and n*n are separate terms: chunked causal prefill makes every new token attend to
all p reused keys but, on average, to only about half of the new ones, so the MLA cost is
about n*p + n*n/2 (plus the per-chunk gather of earlier rows, another n*p term); one shared
coefficient on n*(n+p) would misfit either the no-reuse or the long-reuse regime. KDA, MoE
and projections are linear in n; loading a reused prefix is linear in p.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.blocks import Tier

FORMAT_NAME = "tidekv-calibration"
FORMAT_VERSION = 1
BACKENDS = ("tcp", "shm", "ucx")
_FALLBACK_BACKEND = {"ucx": "tcp"}
_FALLBACK_TIER = {Tier.DEVICE: Tier.DRAM}
# Fitted coefficients, in the order of the fit's features (costmodel.fit).
PREFILL_TERMS = ("prefill_const_s", "prefill_s_per_token", "prefill_s_per_token_x_reused",
                 "prefill_s_per_token_sq", "reuse_s_per_token")
DECODE_TERMS = ("decode_base_s", "decode_s_per_request", "decode_s_per_context_token")
COEFFICIENTS = PREFILL_TERMS + DECODE_TERMS
_MAPPINGS = ("links", "tier_reads", "fit_errors")


class CalibrationError(ValueError):
    """A calibration file is missing, unreadable, malformed or for another setup; the message
    names the file and what is wrong."""


@dataclass(frozen=True)
class LinkCost:
    """Time to move or read ``num_bytes``: ``latency_s + num_bytes * s_per_byte`` (0 for 0 bytes)."""

    latency_s: float
    s_per_byte: float

    def time_s(self, num_bytes: int) -> float:
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        return 0.0 if num_bytes == 0 else self.latency_s + num_bytes * self.s_per_byte


@dataclass(frozen=True)
class FitError:
    """Relative errors |predicted - measured| / measured on held-out points (never fitted on)."""

    median_rel_err: float
    max_rel_err: float
    num_fit: int
    num_held_out: int


@dataclass(frozen=True)
class CalibrationInfo:
    """Where and how a calibration was made. ``grid``: "quick", "full", "smoke" or "analytic"."""

    model_fingerprint: str = ""
    model_name: str = ""
    device: str = ""
    torch_threads: int = 0
    created_at: str = ""
    grid: str = "analytic"
    block_size: int = 0
    snapshot_interval_blocks: int = 0
    torch_version: str = ""
    wall_s: float = 0.0


@dataclass(frozen=True)
class CostModels:
    """Predicted times of a prefill, a decode step and a block transfer (see the module docstring).

    ``kv_bytes_per_token``: MLA latent rows of all MLA layers for one token; ``snapshot_bytes``:
    one KDA snapshot (recurrent state + conv window of every KDA layer). ``links``: per backend;
    ``tier_reads``: the holder's read cost per tier (DEVICE uses DRAM's when absent).
    ``fit_errors``: held-out errors by name ("prefill", "decode", "transfer", "link.tcp", ...).
    """

    kv_bytes_per_token: int
    snapshot_bytes: int
    prefill_const_s: float
    prefill_s_per_token: float
    prefill_s_per_token_x_reused: float
    prefill_s_per_token_sq: float
    reuse_s_per_token: float
    decode_base_s: float
    decode_s_per_request: float
    decode_s_per_context_token: float
    links: Mapping[str, LinkCost]
    tier_reads: Mapping[Tier, LinkCost] = field(default_factory=dict)
    fit_errors: Mapping[str, FitError] = field(default_factory=dict)
    info: CalibrationInfo = field(default_factory=CalibrationInfo)

    def __post_init__(self) -> None:
        for name in _MAPPINGS:  # read-only views of private copies: the value stays frozen
            object.__setattr__(self, name, types.MappingProxyType(dict(getattr(self, name))))
        for name in COEFFICIENTS:
            value = float(getattr(self, name))
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
            object.__setattr__(self, name, value)
        for name, cost in [*self.links.items(), *self.tier_reads.items()]:
            for v in (cost.latency_s, cost.s_per_byte):
                if not (math.isfinite(v) and v >= 0):
                    raise ValueError(f"cost of {name}: coefficients must be finite and >= 0, got {cost}")
        if self.kv_bytes_per_token <= 0 or self.snapshot_bytes < 0:
            raise ValueError(f"kv_bytes_per_token {self.kv_bytes_per_token} must be > 0 and "
                             f"snapshot_bytes {self.snapshot_bytes} >= 0")
        unknown = set(self.links) - set(BACKENDS)
        if unknown or "tcp" not in self.links:
            raise ValueError(f"links must include 'tcp' and only name {BACKENDS}, got {sorted(self.links)}")

    def __getstate__(self) -> dict:  # mapping proxies do not pickle (Ray, multiprocessing, deepcopy)
        return {k: dict(v) if k in _MAPPINGS else v for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, types.MappingProxyType(v) if k in _MAPPINGS else v)

    # ---- predictions ------------------------------------------------------------------------
    def prefill_s(self, num_new_tokens: int, num_reused_tokens: int) -> float:
        """Worker time of one prefill: load the reused prefix from the local DRAM store, run
        chunked prefill of the new tokens over it, store the new blocks. >= 0, non-decreasing
        in both arguments."""
        n, p = num_new_tokens, num_reused_tokens
        if n < 0 or p < 0:
            raise ValueError(f"token counts must be >= 0, got new={n} reused={p}")
        return (self.prefill_const_s + n * self.prefill_s_per_token + n * p * self.prefill_s_per_token_x_reused
                + n * n * self.prefill_s_per_token_sq + p * self.reuse_s_per_token)

    def decode_step_s(self, batch_size: int, num_context_tokens: int) -> float:
        """One continuous-batching step (forward + sampling) for batch_size requests holding
        num_context_tokens tokens in total; 0 for an empty batch. Fitted on batches of equal
        lengths: the engine pads to the longest, so a skewed batch costs more than predicted."""
        if batch_size < 0 or num_context_tokens < 0:
            raise ValueError(f"batch_size {batch_size} and num_context_tokens {num_context_tokens} must be >= 0")
        if batch_size == 0:
            return 0.0
        return (self.decode_base_s + batch_size * self.decode_s_per_request
                + num_context_tokens * self.decode_s_per_context_token)

    def link_s(self, num_bytes: int, backend: str = "tcp") -> float:
        """Sending num_bytes of encoded blocks over backend, received and verified at the puller."""
        return self._link(backend).time_s(num_bytes)

    def read_s(self, num_bytes: int, tier: Tier = Tier.DRAM) -> float:
        """Reading num_bytes of encoded blocks from the holder's tier (0 when no cost is known)."""
        tier = Tier(tier)
        cost = self.tier_reads.get(tier) or self.tier_reads.get(_FALLBACK_TIER.get(tier, tier))
        if cost is None:
            if self.tier_reads:
                raise ValueError(f"no read cost for tier {tier.name}; calibrated: "
                                 f"{[t.name for t in self.tier_reads]}")
            return 0.0
        return cost.time_s(num_bytes)

    def transfer_s(self, num_bytes: int, backend: str = "tcp", tier: Tier = Tier.DRAM) -> float:
        """Moving num_bytes of blocks from a holder worker's tier to another worker over backend."""
        return self.read_s(num_bytes, tier) + self.link_s(num_bytes, backend)

    def pull_bytes(self, num_tokens: int, num_snapshots: int) -> int:
        if num_tokens < 0 or num_snapshots < 0:
            raise ValueError(f"num_tokens {num_tokens} and num_snapshots {num_snapshots} must be >= 0")
        return num_tokens * self.kv_bytes_per_token + num_snapshots * self.snapshot_bytes

    def pull_s(self, num_tokens: int, num_snapshots: int, backend: str = "tcp", tier: Tier = Tier.DRAM) -> float:
        """transfer_s of num_tokens MLA rows plus num_snapshots KDA snapshots."""
        return self.transfer_s(self.pull_bytes(num_tokens, num_snapshots), backend, tier)

    def _link(self, backend: str) -> LinkCost:
        cost = self.links.get(backend) or self.links.get(_FALLBACK_BACKEND.get(backend, ""))
        if cost is None:
            raise ValueError(f"unknown transfer backend {backend!r}; known: {sorted(self.links)}")
        return cost

    # ---- construction and files ---------------------------------------------------------------
    @classmethod
    def analytic(
        cls, *, prefill_s_per_token: float, prefill_s_per_token_sq: float = 0.0, reuse_s_per_token: float = 0.0,
        decode_base_s: float, decode_s_per_request: float = 0.0, decode_s_per_context_token: float = 0.0,
        transfer_bytes_per_s: float = 1e9, transfer_latency_s: float = 0.0,
        kv_bytes_per_token: int = 1, snapshot_bytes: int = 0,
    ) -> CostModels:
        """Hand-set coefficients (tests, simulator). Exactly::

            prefill_s     = new*prefill_s_per_token + new*(new+reused)*prefill_s_per_token_sq
                            + reused*reuse_s_per_token
            decode_step_s = decode_base_s + batch*decode_s_per_request + context*decode_s_per_context_token
            transfer_s    = transfer_latency_s + bytes/transfer_bytes_per_s  (any backend, any tier; 0 bytes: 0)
        """
        if not transfer_bytes_per_s > 0:
            raise ValueError(f"transfer_bytes_per_s must be > 0, got {transfer_bytes_per_s}")
        link = LinkCost(float(transfer_latency_s), 1.0 / transfer_bytes_per_s)
        return cls(
            kv_bytes_per_token=kv_bytes_per_token, snapshot_bytes=snapshot_bytes, prefill_const_s=0.0,
            prefill_s_per_token=float(prefill_s_per_token), prefill_s_per_token_x_reused=float(prefill_s_per_token_sq),
            prefill_s_per_token_sq=float(prefill_s_per_token_sq), reuse_s_per_token=float(reuse_s_per_token),
            decode_base_s=float(decode_base_s), decode_s_per_request=float(decode_s_per_request),
            decode_s_per_context_token=float(decode_s_per_context_token),
            links={b: link for b in BACKENDS},
        )


def default_calibration_path(data_dir: str | Path, model_fingerprint: str, device: str, threads: int) -> Path:
    """``<data_dir>/calibration/<fingerprint>-<device>-t<threads>.json`` (unsafe characters become _)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{model_fingerprint}-{device}-t{int(threads)}")
    return Path(data_dir).expanduser() / "calibration" / f"{stem}.json"
