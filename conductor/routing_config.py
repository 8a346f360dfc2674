"""``RoutingConfig``: what the policy factories read (``conductor.routing.register_policy``),
frozen, its defaults written once here (``ConductorConfig`` takes them from it)."""

from __future__ import annotations

from dataclasses import dataclass

ADMISSION_MODES = ("predictive", "early", "none")


@dataclass(frozen=True)
class RoutingConfig:
    """What the policy factories read (``conductor.routing.register_policy``)."""

    admission_mode: str = "predictive"
    balancing_threshold: float = 1.5
    hot_prefix_rate_per_s: float = 1.0
    max_replicas: int = 2
    cache_aware_abs_threshold: int = 4
    cache_aware_rel_threshold: float = 1.5
    kv_cost_overlap_weight: float = 1.0
    kv_cost_temperature: float = 0.0
    seed: int = 0
    pull_from_peers: bool = True  # False: a worker reuses only its own prefix ("local cache-aware")

    def __post_init__(self) -> None:
        if self.admission_mode not in ADMISSION_MODES:
            raise ValueError(f"admission_mode {self.admission_mode!r} is not one of {ADMISSION_MODES}")
        if self.balancing_threshold < 1.0:
            raise ValueError(f"balancing_threshold {self.balancing_threshold} < 1.0")
        if self.max_replicas < 1 or self.hot_prefix_rate_per_s < 0:
            raise ValueError(f"max_replicas {self.max_replicas} must be >= 1 and hot_prefix_rate_per_s >= 0")
        if self.kv_cost_temperature < 0 or self.kv_cost_overlap_weight < 0:
            raise ValueError("kv_cost_temperature and kv_cost_overlap_weight must be >= 0")
