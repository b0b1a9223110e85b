"""The data-parallel strategy ``zero_optimization.stage`` asks for, with its optimizer:
stage 0's gradient buckets (and fp32 masters for fp16/bf16), or ZeRO's flat groups over
the parameters the optimizer holds (stages 1-3)."""

from __future__ import annotations

import torch

from ...errors import UsageError
from ..buckets import DEFAULT_BUCKET_BYTES, GradBuckets, plan_buckets
from ..precision import MasterWeights
from ..strategy import DataParallelStrategy
from ..strategy.compressed import CompressedStage0Strategy, communicates_in_step
from ..strategy.stage0 import Stage0Strategy
from .optimizer import check_one_optimizer, group_members, make_optimizer, source_groups

COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def build_strategy(cfg, module: torch.nn.Module, client, model_parameters, group,
                   world: int, rank: int, replaced: dict | None = None
                   ) -> tuple[DataParallelStrategy, torch.optim.Optimizer | None]:
    """The strategy for this rank and the optimizer stepping what it holds (``replaced``:
    the parameters preparing the module built in place of the user's, by the id of the
    user's)."""
    cfg = check_one_optimizer(cfg, client)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    names, params = [n for n, _ in named], [p for _, p in named]
    source = source_groups(client, model_parameters, params)
    members = group_members(cfg, client, source, params, names, replaced or {})
    comm = COMM_DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None
    if cfg.zero_optimization.stage:
        from ..zero.runtime import build_zero

        kept = sorted({i for m in members for i in m})
        renumber = {i: j for j, i in enumerate(kept)}
        members = [[renumber[i] for i in m] for m in members]
        zero = build_zero(cfg, module, [names[i] for i in kept], [params[i] for i in kept],
                          members, group, world, rank, comm)
        steps = [zero.step_tensors(o) for o in range(len(source))]
        optimizer = make_optimizer(cfg, client, source, steps, group)
        if communicates_in_step(optimizer):
            return _compressed_zero(cfg, zero, optimizer), optimizer
        return zero, optimizer
    size = params[0].element_size() if params else 4
    # DDP-sized buckets; reduce_bucket_size (DeepSpeed's default 5e8, one bucket for most
    # models: no overlap) is for the ZeRO stages, as in DeepSpeed
    layouts = plan_buckets([p.shape for p in params], [p.dtype for p in params],
                           DEFAULT_BUCKET_BYTES // size)
    buckets = GradBuckets(params, layouts, group, world, comm, names)
    half = cfg.fp16.enabled or cfg.bf16.enabled
    masters = MasterWeights(params, layouts) if half and params else None
    tensors = masters.masters if masters is not None else params
    steps = [[tensors[i] for i in m] for m in members]
    optimizer = make_optimizer(cfg, client, source, steps, group)
    if communicates_in_step(optimizer):
        return CompressedStage0Strategy(buckets, masters, names, optimizer), optimizer
    return Stage0Strategy(buckets, masters, names), optimizer


def _compressed_zero(cfg, zero, optimizer) -> DataParallelStrategy:
    """ZeRO stage 1 exchanging 1-bit Adam's compressed momentum; other stages, or another
    optimizer with the 1-bit protocol (a client's: a config's are checked when parsed),
    are refused."""
    from ..optim.onebit.adam import OneBitAdam
    from ..zero.onebit import OneBitZeroStrategy

    name, stage = type(optimizer).__name__, cfg.zero_optimization.stage
    if stage != 1 or not isinstance(optimizer, OneBitAdam):
        zero.close()  # its hooks: the caller may catch the error and go on
        raise UsageError(f"{name} at ZeRO stage {stage}", where="zero_optimization.stage",
                         hint=f"{name} communicates its compressed momentum in its own "
                              "step: use stage 0 (OneBitAdam: 0 or 1)")
    try:
        return OneBitZeroStrategy.over(zero, optimizer)
    except ValueError as err:
        zero.close()
        raise UsageError(str(err), where="optimizer param groups",
                         hint="drop exp_avg_mask, or use zero_optimization.stage 0") from err
