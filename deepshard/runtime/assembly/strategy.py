"""The data-parallel strategy ``zero_optimization.stage`` asks for, with its optimizer:
stage 0's gradient buckets (and fp32 masters for fp16/bf16), or ZeRO's flat groups over
the parameters the optimizer holds (stages 1-3) (:mod:`.parts`); a model with expert
parameters gets the MoE composite of such strategies (:mod:`.moe`); an optimizer that
communicates in its own step, the compressed variants."""

from __future__ import annotations

import torch

from deepshard.errors import UsageError
from deepshard.runtime.assembly.optimizer import (
    check_one_optimizer,
    group_members,
    make_optimizer,
    source_groups,
)
from deepshard.runtime.assembly.parts import plain_strategy
from deepshard.runtime.parallel.expert_params import is_moe_param
from deepshard.runtime.strategy import DataParallelStrategy
from deepshard.runtime.strategy.compressed import CompressedStage0Strategy, communicates_in_step
from deepshard.runtime.strategy.stage0 import Stage0Strategy
from deepshard.runtime.zero.spec import ZeroSpec

COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def build_strategy(cfg, spec: ZeroSpec, module: torch.nn.Module, client, model_parameters, group,
                   world: int, rank: int, replaced: dict | None = None
                   ) -> tuple[DataParallelStrategy, torch.optim.Optimizer | None]:
    """The strategy for this rank and the optimizer stepping what it holds (``replaced``:
    the parameters preparing the module built in place of the user's, by the id of the
    user's)."""
    cfg = check_one_optimizer(cfg, client)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    names, params = [n for n, _ in named], [p for _, p in named]
    source = source_groups(client, model_parameters, params)
    comm = COMM_DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None
    if any(is_moe_param(p) for p in params):
        from deepshard.runtime.assembly.moe import build_moe

        return build_moe(cfg, spec, module, client, source, names, params, group, world, rank,
                         comm, replaced or {})
    members = group_members(cfg, client, source, params, names, replaced or {})
    strategy, steps = plain_strategy(spec, module, names, params, members, group, world, rank,
                                     comm)
    strategy.optimizer_groups = _source_names(module, source)
    optimizer = make_optimizer(cfg, client, source, steps, group)
    if not communicates_in_step(optimizer):
        return strategy, optimizer
    if spec.shards_optimizer:
        return _compressed_zero(spec, strategy, optimizer), optimizer
    assert isinstance(strategy, Stage0Strategy)
    return CompressedStage0Strategy(strategy.buckets, strategy.masters, names,
                                    optimizer), optimizer


def _source_names(module: torch.nn.Module, source) -> tuple[tuple[str, ...], ...]:
    """The module names of each source group's tensors, frozen ones included (tensors
    that are not the module's parameters are left out)."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    return tuple(tuple(name_of[id(p)] for p in (g["params"] if not torch.is_tensor(
        g["params"]) else [g["params"]]) if id(p) in name_of) for g in source)


def _compressed_zero(spec: ZeroSpec, zero, optimizer) -> DataParallelStrategy:
    """ZeRO stage 1 exchanging 1-bit Adam's compressed momentum; other stages, or another
    optimizer with the 1-bit protocol (a client's: a config's are checked when parsed),
    are refused."""
    from deepshard.runtime.optim.onebit.adam import OneBitAdam
    from deepshard.runtime.zero.onebit import OneBitZeroStrategy

    name, stage = type(optimizer).__name__, spec.stage
    if spec.shards_gradients or not isinstance(optimizer, OneBitAdam):
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
