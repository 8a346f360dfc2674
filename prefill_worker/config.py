"""``PrefillConfig``: the prefill worker's frozen settings (flags and ``TIDEKV_*`` variables)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.worker_config import WorkerConfig


@dataclass(frozen=True)
class PrefillConfig(WorkerConfig):
    num_pages: int = field(default=1024, metadata={"help": "MLA cache pages in the engine's pool"})
    snapshot_interval_blocks: int = field(default=4, metadata={"help": "a KDA snapshot every N blocks"})
    device_bytes: int = field(default=256 << 20, metadata={
        "help": "device tier capacity: cached blocks kept in the engine's page pool and reused in place "
                "(pages plus KDA snapshots; the pool's page count bounds it too); 0 turns the tier off"})
    dram_bytes: int = field(default=512 << 20, metadata={"help": "DRAM tier capacity"})
    ssd_bytes: int = field(default=1 << 30, metadata={"help": "SSD tier capacity"})
    data_dir: str = field(default="", metadata={"help": "SSD tier directory (default: a temporary one)"})
    eviction: str = field(default="lru", metadata={"help": "eviction policy: lru, lfu or arc"})
    max_frame_bytes: int = field(default=32 << 20, metadata={"help": "largest KV frame sent to a decode worker"})
    cpp_stages: int = field(default=1, metadata={
        "help": "chunked pipeline parallelism: this instance's ranks each compute a contiguous range of layers, "
                "and a long prompt flows through them in chunks (1: no pipeline)"})
    cpp_chunk_tokens: int = field(default=1024, metadata={"help": "the chunk a pipelined prompt is cut into"})
    fault_corrupt_frame: int = field(default=0, metadata={
        "help": "TEST ONLY: flip a byte of this frame (1-based) of the first transfer connection, once (0: off)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.snapshot_interval_blocks < 1:
            raise ValueError(f"snapshot_interval_blocks {self.snapshot_interval_blocks} < 1")
        if self.cpp_chunk_tokens < 1:
            raise ValueError(f"cpp_chunk_tokens {self.cpp_chunk_tokens} < 1")
        if self.fault_corrupt_frame < 0:
            raise ValueError(f"fault_corrupt_frame {self.fault_corrupt_frame} < 0")
        if self.device_bytes < 0 or self.dram_bytes < 0 or self.ssd_bytes < 0:
            raise ValueError(f"device_bytes {self.device_bytes}, dram_bytes {self.dram_bytes} and ssd_bytes "
                             f"{self.ssd_bytes} must be >= 0")
