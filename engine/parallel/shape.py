"""The parallel shape of one instance: how many ranks, and what each one holds.

Owns ``ParallelShape`` (tensor parallel size ``tp``, expert parallel size ``ep``, pipeline
stages ``stages``), its checks against a model config (every split must divide what it
splits; the error names the field, its value and the size), and the rank layout::

    world = stages x ep x tp ranks          rank = stage * (ep * tp) + e * tp + t

    stage   which layers the rank computes (chunked pipeline parallelism: layer ranges)
    e       which routed experts it holds (expert parallelism)
    t       which attention heads, MLP columns and vocabulary rows it holds (tensor parallelism)

Attention, the dense MLPs and the vocabulary are split over ``t`` and replicated over ``e``;
routed experts are split over ``e`` (each expert's intermediate dimension over ``t``); the
shared experts' intermediate dimension is split over all ``ep * tp`` ranks of a stage. Rank 0
is the instance's face (gRPC, registration, the canonical cache). Frozen; pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the model's config imports torch (its rope); a worker's config must not
    from engine.config import ModelConfig


@dataclass(frozen=True)
class ParallelShape:
    tp: int = 1
    ep: int = 1
    stages: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel shape: {name} must be >= 1, got {getattr(self, name)}")
        if self.stages > 1 and self.ranks_per_stage > 1:
            raise ValueError(f"parallel shape: a pipeline of {self.stages} stages runs one rank per stage; "
                             f"tp={self.tp} x ep={self.ep} within a stage is not supported")

    @property
    def ranks_per_stage(self) -> int:
        return self.tp * self.ep

    @property
    def world_size(self) -> int:
        return self.stages * self.ranks_per_stage

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, e, t) of ``rank``; ValueError outside the world."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the instance's world of {self.world_size} ranks "
                             f"(tp={self.tp}, ep={self.ep}, stages={self.stages})")
        stage, within = divmod(rank, self.ranks_per_stage)
        e, t = divmod(within, self.tp)
        return stage, e, t

    def describe(self) -> str:
        return f"tp={self.tp} ep={self.ep} stages={self.stages}"

    def check(self, cfg: ModelConfig) -> None:
        """ValueError naming the first config field this shape cannot split."""
        splits = [
            ("num_attention_heads", cfg.num_attention_heads, self.tp, "tp"),
            ("vocab_size", cfg.vocab_size, self.tp, "tp"),
            ("intermediate_size", cfg.intermediate_size, self.tp, "tp"),
            ("num_experts", cfg.num_experts, self.ep, "ep"),
            ("moe_intermediate_size", cfg.moe_intermediate_size, self.tp, "tp"),
            ("moe_intermediate_size * num_shared_experts", cfg.moe_intermediate_size * cfg.num_shared_experts,
             self.ranks_per_stage, "tp*ep"),
        ]
        if cfg.kda_layer_ids:
            splits.append(("kda_num_heads", cfg.kda_num_heads, self.tp, "tp"))
        for name, value, parts, what in splits:
            if value % parts:
                raise ValueError(f"{name}={value} is not divisible by {what}={parts}: "
                                 f"this model cannot run with {self.describe()}")
        if self.stages > cfg.num_hidden_layers:
            raise ValueError(f"stages={self.stages} exceeds num_hidden_layers={cfg.num_hidden_layers}")

    def stage_layers(self, num_layers: int, stage: int) -> range:
        """The layers pipeline stage ``stage`` computes: contiguous, as even as possible
        (earlier stages take the remainder)."""
        base, extra = divmod(num_layers, self.stages)
        lo = stage * base + min(stage, extra)
        return range(lo, lo + base + (1 if stage < extra else 0))


SINGLE = ParallelShape()
