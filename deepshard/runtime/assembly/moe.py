"""The strategy and optimizer of a model with MoE layers (expert parameters, marked as
:mod:`deepshard.runtime.parallel.expert_params` says): the expert-parallel groups made
(:func:`deepshard.runtime.parallel.expert_groups.configure`), the optimizer's param groups
kept apart by expert group, one plain strategy per part (:mod:`.parts`) and the composite
(:class:`~deepshard.runtime.strategy.moe.MoEStrategy`) over them.

Param groups: a config-built optimizer, or a client's callable, gets the groups split as
DeepSpeed splits them (``split_params_into_different_moe_groups_for_optimizer``); a
client's optimizer object keeps its groups, and one group may hold dense and expert
parameters (DeepSpeed 0.19.8 accepts that at stage 0 and asserts at stages 1-2; here each
part steps its own tensors of the group with the group's hyperparameters, at every
stage).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from deepshard.errors import UsageError
from deepshard.runtime.assembly.optimizer import group_members, make_optimizer
from deepshard.runtime.assembly.parts import plain_strategy
from deepshard.runtime.parallel.expert_groups import configure
from deepshard.runtime.parallel.expert_params import (
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)
from deepshard.runtime.strategy.compressed import communicates_in_step
from deepshard.runtime.strategy.moe import MoEStrategy, Part
from deepshard.runtime.zero.spec import ZeroSpec

DENSE = "dense"


def build_moe(cfg, spec: ZeroSpec, module: torch.nn.Module, client, source: list[dict],
              names: list[str], params: list[torch.nn.Parameter], group, world: int,
              rank: int, comm, replaced: dict) -> tuple[MoEStrategy, torch.optim.Optimizer | None]:
    """``build_strategy`` for a model with expert parameters (see the module docstring)."""
    _check_config(cfg)
    expert_groups = configure(module, group)
    if not isinstance(client, torch.optim.Optimizer):
        source = split_params_into_different_moe_groups_for_optimizer(
            [{**g, "params": _listed(g["params"], replaced)} for g in source])
    members = group_members(cfg, client, source, params, names, replaced)
    kinds = [_kinds([params[i] for i in m]) for m in members]
    built: dict[str, tuple[Part, list[list[torch.Tensor]]]] = {}
    for kind in sorted({DENSE, *(_name_of(p) for p in params if is_moe_param(p))}):
        built[kind] = _part(spec, module, kind, names, params, members, kinds, expert_groups,
                            group, world, rank, comm)
    # a group's step tensors: each part's of it, dense first (one group may hold several
    # parts' parameters: DeepSpeed accepts such a client optimizer at stage 0)
    steps: list[list[torch.Tensor]] = []
    for o, group_kinds in enumerate(kinds):
        steps.append([t for kind in group_kinds
                      for t in built[kind][1][built[kind][0].opt_groups.index(o)]])
    optimizer = make_optimizer(cfg, client, source, steps, group)
    experts = [built[k][0] for k in sorted(built) if k != DENSE]
    strategy = MoEStrategy(built[DENSE][0], experts, group, world)
    if communicates_in_step(optimizer):
        strategy.close()
        raise UsageError(f"{type(optimizer).__name__} with MoE layers is not supported",
                         where="optimizer", hint="use Adam/AdamW or SGD with MoE models")
    _account_frozen(strategy)
    return strategy, optimizer


def _check_config(cfg) -> None:
    z = cfg.zero_optimization
    if z.stage == 3:
        raise UsageError("ZeRO stage 3 with MoE layers is not supported",
                         where="zero_optimization.stage",
                         hint="use stage 0, 1 or 2 with MoE (expert parameters are sharded "
                              "over their expert-data-parallel group at stages 1-2)")
    offload = z.offload_optimizer
    if offload is not None and offload.device == "nvme":
        raise UsageError("offload_optimizer to nvme with MoE layers is not supported",
                         where="zero_optimization.offload_optimizer.device",
                         hint='use "cpu" or "none" with MoE models')


def _listed(params, replaced: dict) -> list:
    """A group's parameters, each the module replaced (AutoEP: a fused HF expert
    parameter by this rank's per-expert ones) given as its replacements."""
    out = []
    for p in [params] if torch.is_tensor(params) else params:
        new = replaced.get(id(p), p)
        out.extend(new if isinstance(new, list) else [new])
    return out


def _name_of(p: torch.nn.Parameter) -> str:
    return p.group_name if is_moe_param(p) else DENSE


def _kinds(members: Sequence[torch.nn.Parameter]) -> list[str]:
    """The parts an optimizer param group's parameters belong to (dense, expert groups),
    in the parts' order; an empty group is the dense part's."""
    kinds = {_name_of(p) for p in members} or {DENSE}
    return sorted(kinds, key=lambda k: (k != DENSE, k))


def _part(spec: ZeroSpec, module, kind: str, names, params, members, kinds, expert_groups, group,
          world: int, rank: int, comm) -> tuple[Part, list[list[torch.Tensor]]]:
    """One part's strategy over its parameters and the tensors it steps per group."""
    mine = [i for i, p in enumerate(params) if _name_of(p) == kind]
    index = {i: j for j, i in enumerate(mine)}
    opt_groups = tuple(o for o, ks in enumerate(kinds) if kind in ks)
    local = [[index[i] for i in members[o] if i in index] for o in opt_groups]
    local_names = tuple(names[i] for i in mine)
    if kind == DENSE:
        strategy, steps = plain_strategy(spec, module, local_names, [params[i] for i in mine],
                                         local, group, world, rank, comm)
        return Part(kind, strategy, opt_groups, local_names, steps=_ids(steps)), steps
    eg = expert_groups.get(kind)
    if eg is None:
        raise UsageError(f"expert parameters of group {kind} belong to no MoE layer",
                         where="model", hint="mark expert parameters only through "
                                             "deepspeed.moe.layer.MoE")
    renamed = [global_names(module, n, eg.ep_rank, eg.ep_size) for n in local_names]
    edp_world = eg.dp_world // eg.ep_size
    strategy, steps = plain_strategy(spec, module, [r[0] for r in renamed],
                                     [params[i] for i in mine], local, eg.edp_group,
                                     edp_world, eg.edp_rank, comm)
    every = frozenset(n for r in renamed for n in r[1])
    return Part(kind, strategy, opt_groups, local_names, eg.ep_group, eg.ep_size,
                eg.edp_rank, every, _ids(steps)), steps


def _ids(steps: Sequence[Sequence[torch.Tensor]]) -> frozenset[int]:
    return frozenset(id(t) for tensors in steps for t in tensors)


_INDEX = re.compile(r"\d+")


def global_names(module: torch.nn.Module, name: str, ep_rank: int, ep_size: int
                 ) -> tuple[str, list[str]]:
    """``(the name of expert parameter ``name`` with its global expert id, the names of
    the same parameter of every expert of the layer)``: in ``...{experts}.{list}.{j}...``,
    where ``{experts}`` is the module with ``num_local_experts``, local expert ``j`` on
    expert-parallel rank ``r`` is expert ``r * num_local_experts + j``."""
    parts = name.split(".")
    for cut in range(len(parts) - 2, 0, -1):
        owner = module.get_submodule(".".join(parts[:cut - 1]))
        local = getattr(owner, "num_local_experts", None)
        if local is None or not _INDEX.fullmatch(parts[cut]):
            continue
        head, tail, j = parts[:cut], parts[cut + 1:], int(parts[cut])
        every = [".".join([*head, str(g), *tail]) for g in range(local * ep_size)]
        return every[ep_rank * local + j], every
    raise UsageError(f"expert parameter {name} is not inside a module with "
                     "num_local_experts", where="model",
                     hint="build experts with deepspeed.moe.layer.MoE")


def _account_frozen(strategy: MoEStrategy) -> None:
    """ZeRO counts the parameters no flat group of its own holds as replicated ones:
    each part's are another part's, not this one's."""
    for part in strategy.parts:
        if hasattr(part.strategy, "frozen_bytes"):
            others = sum(p.numel() * p.element_size() for other in strategy.parts
                         if other is not part for p in other.strategy.params)
            part.strategy.frozen_bytes = max(0, part.strategy.frozen_bytes - others)
