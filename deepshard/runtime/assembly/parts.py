"""One data-parallel strategy over a given list of parameters and process group, without
its optimizer: stage 0's gradient buckets (and fp32 masters for fp16/bf16), or ZeRO's flat
groups over the parameters the optimizer holds (stages 1-3). :mod:`.strategy` builds one
over every trainable parameter; an MoE model gets one over its dense parameters and one
per expert group (:mod:`.moe`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from deepshard.runtime.buckets import DEFAULT_BUCKET_BYTES, GradBuckets, plan_buckets
from deepshard.runtime.precision import MasterWeights
from deepshard.runtime.strategy import DataParallelStrategy
from deepshard.runtime.strategy.stage0 import Stage0Strategy
from deepshard.runtime.zero.spec import ZeroSpec


def plain_strategy(spec: ZeroSpec, module: torch.nn.Module, names: Sequence[str],
                   params: Sequence[torch.nn.Parameter], members: Sequence[Sequence[int]],
                   group: dist.ProcessGroup | None, world: int, rank: int,
                   comm: torch.dtype | None
                   ) -> tuple[DataParallelStrategy, list[list[torch.Tensor]]]:
    """The strategy ``spec`` asks for over ``params`` (trainable, registration order, named
    ``names``) and the tensors it steps for each optimizer param group (``members``:
    indices into ``params``)."""
    if spec.shards_optimizer:
        from deepshard.runtime.zero.runtime import build_zero

        kept = sorted({i for m in members for i in m})
        renumber = {i: j for j, i in enumerate(kept)}
        local = [[renumber[i] for i in m] for m in members]
        zero = build_zero(spec, module, [names[i] for i in kept], [params[i] for i in kept],
                          local, group, world, rank, comm)
        return zero, [zero.step_tensors(o) for o in range(len(local))]
    size = params[0].element_size() if params else 4
    # DDP-sized buckets; reduce_bucket_size (DeepSpeed's default 5e8, one bucket for most
    # models: no overlap) is for the ZeRO stages, as in DeepSpeed
    layouts = plan_buckets([p.shape for p in params], [p.dtype for p in params],
                           DEFAULT_BUCKET_BYTES // size)
    buckets = GradBuckets(list(params), layouts, group, world, comm, list(names))
    masters = MasterWeights(list(params), layouts) if spec.half and params else None
    tensors = masters.masters if masters is not None else params
    return Stage0Strategy(buckets, masters, names), [[tensors[i] for i in m] for m in members]
