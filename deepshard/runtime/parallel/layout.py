"""The job's (pipe, data, sequence, tensor) layout, from the config and the model: the
process groups, AutoTP, tied pipeline weights, and which engine drives the model.

``deepshard.initialize`` asks :meth:`Layout.create` with the validated config before the
batch triad is resolved, since the data-parallel size depends on the layout; ``None``
means plain data parallelism.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from deepshard.errors import UsageError
from deepshard.runtime.parallel.pipe_module import PipelineModule
from deepshard.runtime.parallel.tied import TiedWeightGroups
from deepshard.runtime.parallel.topology import ProcessGroups, Topology

logger = logging.getLogger("deepshard")


def _apply_pipeline_config(pipe, model: PipelineModule, origin: str) -> None:
    """What the ``pipeline`` section changes in a module built before initialize saw it:
    a positive ``activation_checkpoint_interval`` replaces the module's (as DeepSpeed's
    PipelineEngine does); a partition it cannot change any more is a warning."""
    if pipe.activation_checkpoint_interval > 0:
        model.activation_checkpoint_interval = pipe.activation_checkpoint_interval
    said = {"partition_method": model.partition_method}
    differ = [f"pipeline.{k} = {getattr(pipe, k)!r} (the module has {v!r})"
              for k, v in said.items() if k in pipe.model_fields_set and getattr(pipe, k) != v]
    if differ and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("%s: %s: the PipelineModule was partitioned before initialize read "
                       "the config; pass it to PipelineModule(...) instead", origin,
                       "; ".join(differ))


def pipeline_stages(model) -> int:
    """What ``pipeline.stages: "auto"`` means for ``model``: a ``PipelineModule``'s own
    stage count, else 1."""
    return model.num_stages if isinstance(model, PipelineModule) else 1


@dataclass
class Layout:
    """A model-parallel layout: its topology and this rank's groups."""

    topology: Topology
    groups: ProcessGroups
    pipeline: bool
    tied: TiedWeightGroups | None
    origin: str

    @classmethod
    def create(cls, cfg, origin: str, model, mpu) -> Layout | None:
        """The layout the validated config ``cfg`` asks for (its ``pipeline.stages``
        resolved with :func:`pipeline_stages`); a ``PipelineModule`` brings its own stage
        count. ``None`` when neither asks for model parallelism."""
        stages, tp = cfg.pipeline.stages, cfg.tensor_parallel.autotp_size
        is_pipe = isinstance(model, PipelineModule)
        if is_pipe:
            if "stages" in cfg.pipeline.model_fields_set and stages != model.num_stages:
                raise UsageError(f"pipeline.stages is {stages} but the PipelineModule has "
                                 f"{model.num_stages} stages", where=f"{origin}: "
                                 "pipeline.stages", hint="make them agree (or write 'auto')")
            stages = model.num_stages
            _apply_pipeline_config(cfg.pipeline, model, origin)
        elif stages > 1:
            raise UsageError(f"pipeline.stages is {stages} but the model is a plain "
                             f"{type(model).__name__}", where=f"{origin}: pipeline.stages",
                             hint="build the model as deepshard.pipe.PipelineModule(layers, "
                                  "num_stages=...) or set pipeline.stages to 1")
        sp = cfg.sequence_parallel_size
        if stages == 1 and tp == 1 and not is_pipe:
            return None if sp == 1 else _sequence_layout(cls, sp, origin, mpu)
        if sp > 1:
            raise UsageError(f"sequence_parallel_size {sp} with pipeline or tensor "
                             "parallelism is not supported", where=f"{origin}: "
                             "sequence_parallel_size", hint="use sequence parallelism with "
                             "data parallelism and ZeRO only (as DeepSpeed's Ulysses/ALST)")
        if mpu is not None and (is_pipe or stages > 1):
            raise UsageError("both mpu= and a pipeline layout are given",
                             where="initialize(mpu=...)",
                             hint="let the config define the layout, or pass only mpu")
        topo = model.topology() if is_pipe else None
        if topo is None or topo.tensor != tp:
            topo = Topology.from_config(dist.get_world_size(), stages, tp)
        groups = ProcessGroups.create(topo)
        if mpu is not None:
            _check_user_mpu(mpu, groups, origin)
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
            from deepshard.runtime.parallel.autotp import apply_autotp, plan_autotp

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
            from deepshard.runtime.parallel.pipe_engine import PipelineEngine

            return PipelineEngine(parts, self.groups, cast(TiedWeightGroups, self.tied))  # set
        from deepshard.runtime.engine import DeepShardEngine

        return DeepShardEngine(parts)


def _sequence_layout(cls, sp: int, origin: str, mpu) -> Layout | None:
    """Sequence-parallel groups carved out of the data-parallel ranks; a user's ``mpu``
    (e.g. the one ``UlyssesSPAttentionHF.register_with_transformers`` returns) must have
    groups of the same size, and is then used as it is (``None``)."""
    if mpu is not None:
        theirs = getattr(mpu, "get_sequence_parallel_world_size", lambda: None)()
        if theirs != sp:
            raise UsageError(f"sequence_parallel_size is {sp} but mpu= has sequence-parallel "
                             f"size {theirs}", where=f"{origin}: sequence_parallel_size",
                             hint="make them agree, or drop mpu= and let the config define "
                                  "the groups")
        return None
    topo = Topology.from_config(dist.get_world_size(), sp_size=sp)
    return cls(topo, ProcessGroups.create(topo), False, None, origin)


def _check_user_mpu(mpu, groups: ProcessGroups, origin: str) -> None:
    """A user's ``mpu=`` next to ``tensor_parallel.autotp_size`` (DeepSpeedExamples' AutoTP
    example): deepshard shards with its own groups, so the user's must be the same ranks
    (tensor-parallel ranks consecutive, as DeepSpeed's AutoTP examples build them)."""
    tp = groups.get_tensor_model_parallel_world_size()
    theirs = mpu.get_model_parallel_world_size()
    if theirs != tp:
        raise UsageError(f"mpu= has model-parallel size {theirs} but tensor_parallel."
                         f"autotp_size is {tp}", where=f"{origin}: tensor_parallel.autotp_size",
                         hint="make them agree")
    pairs = (("model-parallel", mpu.get_model_parallel_group(),
              groups.get_tensor_model_parallel_group()),
             ("data-parallel", mpu.get_data_parallel_group(),
              groups.get_data_parallel_group()))
    for what, user, ours in pairs:
        mine = dist.get_process_group_ranks(user) if user is not None else None
        expected = dist.get_process_group_ranks(ours)
        if mine != expected:
            raise UsageError(f"the {what} group of mpu= holds ranks {mine}, but AutoTP "
                             f"with autotp_size {tp} puts rank {dist.get_rank()} with "
                             f"ranks {expected}", where="initialize(mpu=...)",
                             hint="build tensor-parallel groups of consecutive ranks "
                                  "(rank // autotp_size is the data-parallel index), or "
                                  "drop mpu= and let the config define the layout")
