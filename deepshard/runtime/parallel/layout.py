"""The job's (pipe, data, tensor) layout, from the config and the model: the process
groups, AutoTP, tied pipeline weights, and which engine drives the model.

``deepshard.initialize`` asks :meth:`Layout.create` first (before the config's batch
triad is checked, since the data-parallel size depends on the layout); ``None`` means
plain data parallelism.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...errors import UsageError
from .pipe_module import PipelineModule
from .tied import TiedWeightGroups
from .topology import ProcessGroups, Topology

logger = logging.getLogger("deepshard")


def _warn_if_ignored(pipe: Mapping[str, Any], model: PipelineModule, origin: str) -> None:
    """The module is built before initialize sees the config: say when the config asks
    for another partition or checkpoint interval than the module was built with."""
    said = {"partition_method": model.partition_method,
            "activation_checkpoint_interval": model.activation_checkpoint_interval}
    differ = [f"pipeline.{k} = {pipe[k]!r} (the module has {v!r})" for k, v in said.items()
              if k in pipe and pipe[k] != v]
    if differ and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("%s: %s: the PipelineModule was built before initialize read the "
                       "config; pass these to PipelineModule(...) instead", origin,
                       "; ".join(differ))


@dataclass
class Layout:
    """A model-parallel layout: its topology and this rank's groups."""

    topology: Topology
    groups: ProcessGroups
    pipeline: bool
    tied: TiedWeightGroups | None
    origin: str

    @classmethod
    def create(cls, data: Mapping[str, Any], origin: str, model, mpu) -> Layout | None:
        """The layout ``data`` (the raw config) asks for; a ``PipelineModule`` brings its
        own stage count. ``None`` when neither asks for model parallelism."""
        pipe = data.get("pipeline") or {}
        stages = pipe.get("stages", "auto") if isinstance(pipe, Mapping) else "auto"
        tp_section = data.get("tensor_parallel") or {}
        tp = tp_section.get("autotp_size", 1) if isinstance(tp_section, Mapping) else 1
        tp = tp if isinstance(tp, int) and tp > 0 else 1
        is_pipe = isinstance(model, PipelineModule)
        if is_pipe:
            if isinstance(stages, int) and stages != model.num_stages:
                raise UsageError(f"pipeline.stages is {stages} but the PipelineModule has "
                                 f"{model.num_stages} stages", where=f"{origin}: "
                                 "pipeline.stages", hint="make them agree (or write 'auto')")
            stages = model.num_stages
            _warn_if_ignored(pipe, model, origin)
        elif isinstance(stages, int) and stages > 1:
            raise UsageError(f"pipeline.stages is {stages} but the model is a plain "
                             f"{type(model).__name__}", where=f"{origin}: pipeline.stages",
                             hint="build the model as deepshard.pipe.PipelineModule(layers, "
                                  "num_stages=...) or set pipeline.stages to 1")
        else:
            stages = 1
        if stages == 1 and tp == 1 and not is_pipe:
            return None
        if mpu is not None:
            raise UsageError("both mpu= and a pipeline/tensor_parallel layout are given",
                             where="initialize(mpu=...)",
                             hint="let the config define the layout, or pass only mpu")
        topo = model.topology() if is_pipe else None
        if topo is None or topo.tensor != tp:
            topo = Topology.from_config(dist.get_world_size(), stages, tp)
        groups = ProcessGroups.create(topo)
        tied = TiedWeightGroups.create(model, topo) if is_pipe else None
        return cls(topo, groups, is_pipe, tied, origin)

    def prepare(self, module: torch.nn.Module,
                broadcast: Callable[[torch.nn.Module, Any, int], None], rank: int
                ) -> frozenset[int]:
        """Shard ``module`` with AutoTP when asked (after making the tensor-parallel ranks'
        dense copies equal), make tied replicas equal, and return the ids of parameters
        the gradient norm must leave out on this rank (replicas counted elsewhere)."""
        excluded: set[int] = set()
        t = self.topology.tensor
        if t > 1:
            from .autotp import apply_autotp, plan_autotp

            group = self.groups.tensor_group
            broadcast(module, group, t)
            plan = plan_autotp(module, t)
            apply_autotp(module, plan, group)
            sharded = set(plan.param_layout())
            if self.groups.get_tensor_model_parallel_rank() != 0:
                excluded |= {id(p) for n, p in module.named_parameters() if n not in sharded}
        if self.tied is not None:
            self.tied.broadcast_weights(module)
            excluded |= {id(p) for p in self.tied.duplicates(module, rank)}
        return frozenset(excluded)

    def engine(self, parts):
        """The engine for this layout."""
        if self.pipeline:
            from .pipe_engine import PipelineEngine

            return PipelineEngine(parts, self.groups, self.tied)
        from ..engine import DeepShardEngine

        return DeepShardEngine(parts)
