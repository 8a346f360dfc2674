"""The collectives the model's forward passes call: sums and gathers over a rank's groups.

Owns ``Comm`` (the interface the model sees), ``LOCAL`` (one rank: every call is the
identity) and ``DistComm`` over ``torch.distributed`` process groups::

    tp group      the tp ranks of one (stage, e): attention heads, dense MLP, vocabulary
    stage group   the ep * tp ranks of one stage: the MoE's routed + shared experts

``reduce_tp`` after a row-parallel projection (attention's o_proj, the dense MLP's down_proj);
``reduce_stage`` after the MoE (routed experts partitioned over e and split over t, shared
experts split over the whole stage: one sum combines both); ``gather_tp`` concatenates the
vocabulary slices of the logits. Sums run in place on contiguous tensors, through a group's
``HostReducer`` (``engine.parallel.host_reduce``: shared memory) when its ranks share a host and
tensors are on CPU, else through the process group. A failed collective (a rank died) raises
``GroupFailed``.

Each call counts its time and bytes (``stats``), which ``bench/parallel.py`` reports as the
communication share. Not thread-safe: one thread drives a rank's forward passes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class GroupFailed(RuntimeError):
    """A rank of this instance is gone or unreachable (a collective failed): the instance can
    no longer compute and must restart as a whole."""


def collective(fn, *args, **kwargs):
    """Runs one ``torch.distributed`` call; a lost peer (gloo and NCCL raise RuntimeError)
    becomes ``GroupFailed``."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ValueError) as e:
        raise GroupFailed(f"a collective failed ({e})") from e


@dataclass
class CommStats:
    """Calls, seconds and payload bytes per collective kind since the last ``reset``."""

    calls: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, t0: float, tensor: torch.Tensor) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - t0
        self.bytes[kind] = self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.seconds.clear()
        self.bytes.clear()

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


class Comm:
    """One rank's collectives; this base class is a single rank (every call the identity)."""

    tp_size = 1
    stage_size = 1

    def __init__(self) -> None:
        self.stats = CommStats()

    def reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the tp group (returned; ``x`` may be reused)."""
        return x

    def reduce_stage(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over every rank of the stage."""
        return x

    def gather_tp(self, x: torch.Tensor) -> torch.Tensor:
        """The tp group's ``x`` concatenated along the last dimension, in tp order."""
        return x


LOCAL = Comm()


class DistComm(Comm):
    """Collectives over ``torch.distributed`` groups (gloo on CPU, NCCL on CUDA). ``tp_group``
    and ``stage_group`` are process groups this rank belongs to (None: a group of one);
    ``tp_host`` / ``stage_host``: their shared-memory collectives (``HostReducer``; None: the
    group's); ``world_host``: the whole instance's, which rank 0's ``Channel`` broadcasts on."""

    def __init__(self, tp_group: dist.ProcessGroup | None, tp_size: int,
                 stage_group: dist.ProcessGroup | None, stage_size: int, tp_host=None, stage_host=None,
                 world_host=None):
        super().__init__()
        self.tp_group, self.tp_size, self.tp_host = tp_group, tp_size, tp_host
        self.stage_group, self.stage_size, self.stage_host = stage_group, stage_size, stage_host
        self.world_host = world_host

    def _sum(self, x: torch.Tensor, group: dist.ProcessGroup | None, size: int, host, kind: str) -> torch.Tensor:
        if size == 1:
            return x
        t0 = time.perf_counter()
        x = x.contiguous()
        if host is not None and x.device.type == "cpu":
            host.sum_(x)
        else:
            collective(dist.all_reduce, x, group=group)
        self.stats.add(kind, t0, x)
        return x

    def reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        return self._sum(x, self.tp_group, self.tp_size, self.tp_host, "reduce_tp")

    def reduce_stage(self, x: torch.Tensor) -> torch.Tensor:
        return self._sum(x, self.stage_group, self.stage_size, self.stage_host, "reduce_stage")

    @property
    def sums_on_host(self) -> bool:
        """Whether this rank's sums go through shared memory (``engine.parallel.host_reduce``)."""
        return any(h is not None for h in (self.tp_host, self.stage_host))

    def close(self) -> None:
        """Releases the shared-memory collectives (the process groups are ``leave_group``'s)."""
        hosts = (self.tp_host, self.stage_host, self.world_host)
        for host in {id(h): h for h in hosts if h is not None}.values():
            host.close()
        self.tp_host = self.stage_host = self.world_host = None

    def gather_tp(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        t0 = time.perf_counter()
        x = x.contiguous()
        if self.tp_host is not None and x.device.type == "cpu":
            parts: Sequence[torch.Tensor] = list(self.tp_host.all_gather(x))
        else:
            parts = [torch.empty_like(x) for _ in range(self.tp_size)]
            collective(dist.all_gather, list(parts), x, group=self.tp_group)
        self.stats.add("gather_tp", t0, x)
        return torch.cat(list(parts), -1)
