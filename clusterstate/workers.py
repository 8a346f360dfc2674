"""A worker as the cluster knows it: its registration (``WorkerInfo``) and its load
(``WorkerLoad``, with the prefill jobs it holds), frozen values.

One shape per concept: the Register message becomes a ``WorkerInfo`` once
(``proto.convert.worker_from_proto``) and that value is what the registry keeps, the log
carries and the routing snapshot reads; a heartbeat's load becomes a ``WorkerLoad`` once.
"""

from __future__ import annotations

import dataclasses
import enum
import math


class WorkerRole(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker told the Conductor when it registered. ``instance_id`` is the secret that
    binds the id to one process (``runtime.auth.session_key``): the registry keeps it, the
    shared store holds it only sealed (``clusterstate.records.StoreKeys``), ``Workers`` never returns it."""

    worker_id: str
    role: WorkerRole
    rpc_address: str
    num_pages_total: int
    dram_capacity_bytes: int = 0
    ssd_capacity_bytes: int = 0
    transfer_address: str = ""
    metrics_address: str = ""
    model_fingerprint: str = ""
    block_size: int = 0
    instance_id: str = ""
    # The instance's parallel shape (engine.parallel.shape): a group of ranks registered once.
    tp_size: int = 1
    ep_size: int = 1
    cpp_stages: int = 1  # prefill: chunked-pipeline stages (1: no pipeline)
    cpp_chunk_tokens: int = 0  # prefill with cpp_stages > 1: the chunk a pipelined prompt is cut into

    def __post_init__(self) -> None:
        if not self.worker_id or ":" in self.worker_id or "/" in self.worker_id:
            raise ValueError(f"worker_id must be non-empty and contain no ':' or '/', got {self.worker_id!r}")
        for name in ("tp_size", "ep_size", "cpp_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cpp_stages > 1 and self.cpp_chunk_tokens < 1:
            raise ValueError(f"a pipeline of {self.cpp_stages} stages needs cpp_chunk_tokens >= 1")
        for name in ("num_pages_total", "dram_capacity_bytes", "ssd_capacity_bytes", "block_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def public(self) -> WorkerInfo:
        """This registration without its instance id (what ``Workers`` and logs may show)."""
        return dataclasses.replace(self, instance_id="")


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillJobLoad:
    """One prefill a worker holds: queued (``elapsed_s == 0``) or running."""

    request_id: str
    num_new_tokens: int
    num_reused_tokens: int = 0
    elapsed_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_new_tokens < 0 or self.num_reused_tokens < 0 or not 0 <= self.elapsed_s < math.inf:
            raise ValueError(f"prefill job {self.request_id!r}: negative count or elapsed_s not finite in {self}")


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load as of ``timestamp_s`` (the worker's wall clock, seconds since the epoch).

    The one load value from the wire (``proto.convert.load_from_proto``) through the registry
    to the routing snapshot. Prefill workers fill ``prefill_jobs`` (queued and running
    prefills); decode workers fill ``num_queued`` (reserved, not yet decoding),
    ``num_running``, ``num_context_tokens`` and ``request_ids`` (every request holding pages).
    """

    num_queued: int = 0
    num_running: int = 0
    num_free_pages: int = 0
    num_context_tokens: int = 0
    prefill_jobs: tuple[PrefillJobLoad, ...] = ()
    request_ids: tuple[str, ...] = ()
    timestamp_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_queued", "num_running", "num_free_pages", "num_context_tokens", "timestamp_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def initial(cls, info: WorkerInfo) -> WorkerLoad:
        """Load assumed between registration and the first heartbeat: idle, everything free."""
        return cls(num_free_pages=info.num_pages_total)
