"""``DecodeConfig``: the decode worker's frozen settings (flags and ``TIDEKV_*`` variables)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.worker_config import WorkerConfig


@dataclass(frozen=True)
class DecodeConfig(WorkerConfig):
    num_pages: int = field(default=2048, metadata={"help": "MLA cache pages in the engine's pool"})
    num_slots: int = field(default=64, metadata={"help": "KDA state slots: most requests held at once"})
    max_batch: int = field(default=32, metadata={"help": "most requests in one decode step"})
    transfer_deadline_s: float = field(default=60.0, metadata={"help": "longest wait for a request's KV"})
    reservation_ttl_s: float = field(default=30.0, metadata={
        "help": "a reservation whose Decode call never comes (its Conductor died) is freed after this long "
                "without its Conductor renewing it or its KV arriving; one whose KV transfer failed (the "
                "prefill worker's ABORT) at once"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reservation_ttl_s <= 0:
            raise ValueError(f"reservation_ttl_s {self.reservation_ttl_s} must be > 0")
        if self.num_slots < 1 or self.max_batch < 1:
            raise ValueError(f"num_slots {self.num_slots} and max_batch {self.max_batch} must be >= 1")
