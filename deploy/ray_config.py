"""What a Tidekv cluster on Ray is made of, as data: each role's config, pool sizes, placement
(``Placement``: CPUs, custom resources, the spread of a pool's placement groups), restarts and
timeouts (``RayClusterConfig``), and the names actors go by (``conductor_name``). Frozen values,
checked when built; no Ray import, so the CLI validates flags without starting Ray.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from conductor.config import ConductorConfig
from decode_worker.config import DecodeConfig
from openai_api.config import FrontConfig
from prefill_worker.config import PrefillConfig

NAMESPACE = "tidekv"
CONDUCTOR = "conductor"  # replica 0's actor; replica R's is "conductor-R"
HTTP = "http"
POOLS = ("prefill", "decode")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
Resources = tuple[tuple[str, float], ...]


def parse_resources(text: str) -> Resources:
    """``"tidekv_prefill=1,node_type_a=0.01"`` -> ``(("tidekv_prefill", 1.0), ...)``; "" is none."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, amount = part.partition("=")
        try:
            if not (name and sep) or float(amount) <= 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"resource {part!r}: expected NAME=AMOUNT with AMOUNT > 0") from None
        out.append((name, float(amount)))
    return tuple(out)


@dataclass(frozen=True)
class Placement:
    """What each actor of a role asks Ray for; ``strategy`` spreads a pool group's bundles."""

    num_cpus: float = 0.25
    resources: Resources = ()
    strategy: str = "PACK"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"placement strategy {self.strategy!r} is not one of {STRATEGIES}")
        if self.num_cpus < 0:
            raise ValueError(f"num_cpus {self.num_cpus} < 0")

    def bundle(self, num_gpus: int) -> dict[str, float]:
        return {"CPU": self.num_cpus, **dict(self.resources), **({"GPU": float(num_gpus)} if num_gpus else {})}


@dataclass(frozen=True)
class RayClusterConfig:
    """A Tidekv cluster on Ray: each role's frozen config, pool sizes, placement and restarts.
    Worker configs with ``conductor=""`` find the Conductor through its actor."""

    conductor: ConductorConfig = ConductorConfig()
    prefill: PrefillConfig = PrefillConfig()
    decode: DecodeConfig = DecodeConfig()
    http: FrontConfig = FrontConfig()  # conductor "": the Conductor actor's address
    num_prefill: int = 1
    num_decode: int = 1
    num_http: int = 1  # 0: no HTTP front
    num_conductors: int = 1  # > 1: replicas over the shared state of conductor.index (redis://...)
    namespace: str = NAMESPACE
    conductor_placement: Placement = Placement(resources=(("tidekv_conductor", 1.0),))
    prefill_placement: Placement = Placement(resources=(("tidekv_prefill", 1.0),), strategy="PACK")
    decode_placement: Placement = Placement(resources=(("tidekv_decode", 1.0),), strategy="SPREAD")
    http_placement: Placement = Placement()  # anywhere: it holds no model weights
    max_restarts: int = 3  # per actor; -1: without limit
    ready_timeout_s: float = 180.0
    placement_timeout_s: float = 30.0
    extra: dict[str, Any] = field(default_factory=dict, hash=False)  # more actor options (runtime_env, ...)

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 0 or self.num_http not in (0, 1):
            raise ValueError(f"num_prefill {self.num_prefill} and num_decode {self.num_decode} must be >= 0, "
                             f"num_http {self.num_http} 0 or 1")
        if self.num_conductors < 1:
            raise ValueError(f"num_conductors {self.num_conductors} must be >= 1")
        if self.num_conductors > 1 and self.conductor.index == "memory":
            raise ValueError(f"num_conductors {self.num_conductors}: replicas share their state through a store "
                             "every node reaches: give the Conductor --index redis://HOST:PORT (or rediss://, "
                             "redis+sentinel://)")

    @property
    def conductor_names(self) -> tuple[str, ...]:
        return tuple(conductor_name(r) for r in range(self.num_conductors))

    def replica_config(self, replica: int) -> ConductorConfig:
        """Replica ``replica``'s Conductor config: fixed ports moved up by its number."""
        c = self.conductor
        return dataclasses.replace(c, port=c.port + replica if c.port else 0,
                                   metrics_port=c.metrics_port + replica if c.metrics_port > 0 else c.metrics_port)

    def role_config(self, role: str) -> Any:
        return getattr(self, role)

    def placement(self, role: str) -> Placement:
        return getattr(self, f"{role}_placement")

    def num_gpus(self, role: str) -> int:
        return 1 if getattr(self.role_config(role), "device", "cpu").startswith("cuda") else 0


def conductor_name(replica: int) -> str:
    return CONDUCTOR if replica == 0 else f"{CONDUCTOR}-{replica}"


CONDUCTOR_NAMES = re.compile(rf"{CONDUCTOR}(-[1-9]\d*)?")
