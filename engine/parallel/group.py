"""The process group of one instance, and the channel rank 0 drives the other ranks through.

Owns ``init_group`` (``torch.distributed`` with gloo on CPU, NCCL on CUDA; the world of one
instance, its tp and stage subgroups, every rank creating every group in the same order) and
``Channel``: the broadcasts, scatters, gathers and point-to-point sends with which rank 0
hands its schedule to the others (``engine.parallel.leader`` / ``follower``). Every failed
collective raises ``GroupFailed``: with gloo a rank that dies closes its connections, so the
others' next collective fails within milliseconds instead of waiting for a timeout.

Not thread-safe: one thread per rank drives its collectives (rank 0's ``GroupModel``
serialises its callers).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.parallel.comm import DistComm, GroupFailed
from engine.parallel.host_reduce import open_host_reducer
from engine.parallel.shape import ParallelShape

log = logging.getLogger(__name__)
__all__ = ["Channel", "GroupConfig", "GroupFailed", "init_group", "leave_group"]


@dataclass(frozen=True)
class GroupConfig:
    """``init_method``: ``file:///path`` (ranks on one host; the directory should be private)
    or ``tcp://host:port`` (rank 0 hosts the rendezvous there). ``timeout_s`` bounds the
    rendezvous and any one collective (a rank that hangs without dying)."""

    shape: ParallelShape
    rank: int
    init_method: str
    backend: str = ""  # "" -> gloo for cpu, nccl for cuda
    timeout_s: float = 300.0
    host_sums: bool = True  # CPU groups on one host sum through shared memory (host_reduce)

    def backend_for(self, device: str) -> str:
        return self.backend or ("nccl" if torch.device(device).type == "cuda" else "gloo")


def init_group(config: GroupConfig, device: str = "cpu") -> DistComm:
    """Joins this process to its instance's world and builds the subgroups; returns the
    model's collectives. Raises GroupFailed when the rendezvous does not complete."""
    shape = config.shape
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    try:
        dist.init_process_group(config.backend_for(device), init_method=config.init_method, rank=config.rank,
                                world_size=shape.world_size, timeout=datetime.timedelta(seconds=config.timeout_s))
    except (RuntimeError, ValueError) as e:
        raise GroupFailed(f"rank {config.rank} of {shape.world_size} could not join the instance's group "
                          f"at {config.init_method}: {e}") from e
    stage, e_index, _ = shape.coords(config.rank)
    tp_group = stage_group = None
    tp_ranks: list[int] = []
    stage_ranks: list[int] = []
    per_stage = shape.ranks_per_stage
    for s in range(shape.stages):  # every rank creates every group, in one order
        base = s * per_stage
        group = dist.new_group(list(range(base, base + per_stage))) if per_stage > 1 else None
        if s == stage:
            stage_group, stage_ranks = group, list(range(base, base + per_stage))
        for e in range(shape.ep):
            ranks = list(range(base + e * shape.tp, base + (e + 1) * shape.tp))
            group = dist.new_group(ranks) if shape.tp > 1 else None
            if s == stage and e == e_index:
                tp_group, tp_ranks = group, ranks
    hosts: dict[tuple[int, ...], object] = {}  # ranks -> their HostReducer (or None), one per set of ranks

    def host(group, ranks: list[int]):
        if group is None or not config.host_sums or torch.device(device).type != "cpu":
            return None
        if tuple(ranks) not in hosts:
            hosts[tuple(ranks)] = open_host_reducer(group, ranks, config.rank, config.timeout_s)
        return hosts[tuple(ranks)]

    world = list(range(shape.world_size))
    tp_host = host(tp_group, tp_ranks)  # tp, stage, world: every rank in this one order
    stage_host = host(stage_group, stage_ranks)
    world_host = host(dist.group.WORLD if shape.world_size > 1 else None, world)
    comm = DistComm(tp_group, shape.tp, stage_group, per_stage, tp_host, stage_host, world_host)
    _joined.append(comm)
    log.info("rank %d joined its instance (%s, backend %s, sums %s, pid %d)", config.rank, shape.describe(),
             config.backend_for(device), "in shared memory" if comm.sums_on_host else "by the backend", os.getpid())
    return comm


_joined: list[DistComm] = []  # this process's instance collectives, as the default group is torch's


def leave_group() -> None:
    """Releases the shared-memory collectives and destroys the default process group (best
    effort: the others may be gone)."""
    while _joined:
        _joined.pop().close()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError) as e:
            log.debug("destroying the process group: %s", e)


class Channel:
    """Rank 0's schedule to every rank over the world group. Each method is collective: every
    rank of the world calls it with the same shapes, rank 0 with the values. Tensors live on
    ``device`` (the backend's: CPU for gloo, CUDA for NCCL). ``host``: the world's
    shared-memory collectives (``DistComm.world_host``), which carry the broadcasts (the
    schedule itself, per op and per chunk) when every rank is on this host."""

    def __init__(self, rank: int, world_size: int, device: str = "cpu", host=None):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.host = host if self.device.type == "cpu" else None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, ValueError) as e:  # gloo/NCCL report a lost peer as RuntimeError
            raise GroupFailed(f"rank {self.rank}: a collective failed ({e})") from e

    def ints(self, values: Sequence[int] | None, n: int) -> list[int]:
        """``n`` int64 values from rank 0 (``values`` there, None elsewhere)."""
        if n == 0:
            return []
        if self.is_leader:
            assert values is not None and len(values) == n, (n, values)
            t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        else:
            t = torch.empty(n, dtype=torch.int64, device=self.device)
        return self._broadcast(t).tolist()

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` into every rank's ``t`` (same shape and dtype; contiguous)."""
        assert t.is_contiguous()
        return self._broadcast(t)

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        if self.host is not None:
            return self.host.broadcast_(t, 0)
        self._call(dist.broadcast, t, 0)
        return t

    def scatter(self, out: torch.Tensor, parts: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """Part ``r`` of rank 0's ``parts`` into rank r's ``out``."""
        if self.is_leader:
            assert parts is not None and len(parts) == self.world_size
            self._call(dist.scatter, out, [p.contiguous() for p in parts], src=0)
        else:
            self._call(dist.scatter, out, None, src=0)
        return out

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape) at rank 0, in rank order; None elsewhere."""
        t = t.contiguous()
        if self.is_leader:
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            self._call(dist.gather, t, parts, dst=0)
            return parts
        self._call(dist.gather, t, None, dst=0)
        return None

    def send(self, t: torch.Tensor, dst: int) -> None:
        """``t`` to rank ``dst`` (point to point: the pipeline's hidden states and rows)."""
        self._call(dist.send, t.contiguous(), dst)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        self._call(dist.recv, t, src)
        return t
