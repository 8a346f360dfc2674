"""Joining one rank of a parallel instance: the group, this rank's share of the model, its role.

Owns ``RankSpec`` (what a rank needs to know: the model, the shape, its rank, the rendezvous)
and ``join``, which every rank calls: it joins the instance's process group
(``engine.parallel.group``), loads the model's full tensors and keeps this rank's share
(``engine.load_model`` with the rank's ``ShardPlan`` and collectives), and returns rank 0's
``GroupModel`` (the model the worker uses; a ``PipelineModel`` for a pipeline of stages, each
rank then holding only its stage's layers) or another rank's ``Follower`` (whose ``run``
serves rank 0's schedule). No threads or processes of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.parallel.follower import Follower
from engine.parallel.group import Channel, GroupConfig, init_group
from engine.parallel.leader import GroupModel
from engine.parallel.pipeline import StageLayers
from engine.parallel.pipeline_leader import PipelineModel
from engine.parallel.shape import ParallelShape
from engine.parallel.shard import ShardPlan


@dataclass(frozen=True)
class RankSpec:
    model: str
    shape: ParallelShape
    rank: int
    init_method: str  # file:///private/dir/rendezvous or tcp://host:port (engine.parallel.group)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    backend: str = ""
    timeout_s: float = 600.0
    host_sums: bool = True  # engine.parallel.group.GroupConfig.host_sums

    def __post_init__(self) -> None:
        self.shape.coords(self.rank)


def join(spec: RankSpec, on_failure: Callable[[str], None] | None = None) -> GroupModel | PipelineModel | Follower:
    """Joins the group and builds this rank's share. ``on_failure``: rank 0's handler of a lost
    rank (``GroupModel.on_failure``). ValueError when the model does not split in this shape
    (checked before the rendezvous, so a bad shape fails every rank at once); GroupFailed
    when the rendezvous fails."""
    import engine  # the engine package imports this one's modules: import it late

    cfg = engine.load_config(spec.model)
    spec.shape.check(cfg)
    comm = init_group(GroupConfig(spec.shape, spec.rank, spec.init_method, spec.backend, spec.timeout_s,
                                   spec.host_sums), spec.device)
    plan = ShardPlan(spec.shape, spec.rank)
    stages = [StageLayers.of(cfg, spec.shape.stage_layers(cfg.num_hidden_layers, s)) for s in range(spec.shape.stages)]
    shard = engine.load_model(spec.model, spec.device, spec.dtype, plan=plan, comm=comm,
                              layers=stages[plan.stage].layers)
    channel = Channel(spec.rank, spec.shape.world_size, spec.device, comm.world_host)
    if spec.rank == 0:
        keepalive_s = spec.timeout_s / 4  # the others wait for the next op at most the group's timeout
        model: GroupModel | PipelineModel = (
            PipelineModel(shard, channel, stages, on_failure, keepalive_s) if spec.shape.stages > 1
            else GroupModel(shard, channel, on_failure, keepalive_s))
        model.tokenizer = shard.tokenizer
        return model
    return Follower(shard, channel)
