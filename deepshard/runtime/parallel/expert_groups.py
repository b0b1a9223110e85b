"""Expert-parallel and expert-data-parallel process groups of MoE layers.

The runtime's side of MoE: a layer that spreads experts over ranks derives from
:class:`ExpertParallelLayer` (``deepshard.moe``'s ``MOELayer`` does), and the groups, the
strategies and AutoTP find such layers by that base, never by the feature's classes.

Within the data-parallel group's ranks ``d_0 < d_1 < ... < d_{D-1}``, DeepSpeed's default
layout (``use_data_before_expert_parallel_=False``, its
``groups._create_expert_and_data_parallel``) puts the experts of a layer with ``ep_size``
``E`` on consecutive blocks of ``E`` ranks (the expert-parallel groups, over which tokens
travel with all-to-all) and makes the strided sets ``d_i, d_{i+E}, ...`` the
expert-data-parallel groups (the replicas of the same experts, over which expert gradients
are reduced). With ``use_data_before_expert_parallel_=True`` the roles of blocks and strides
swap. A layer's group name is ``ep_size_{E}``; the global id of local expert ``j`` on
expert-parallel rank ``r`` is ``r * num_local_experts + j``.

:func:`configure` is the one place groups are created. It keeps no module-level state:
the groups live on the layers (``layer.expert_groups``), so a second call finds them there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.comm.teardown import keep
from deepshard.errors import UsageError


@dataclass(frozen=True)
class ExpertGroups:
    """The groups one rank uses for the MoE layers of one ``ep_size``.

    Attributes:
        name: ``ep_size_{ep_size}``, the experts' ``param.group_name``.
        ep_size: ranks in an expert-parallel group.
        ep_group: this rank's expert-parallel group (tokens are exchanged over it).
        edp_group: this rank's expert-data-parallel group (expert gradients are reduced
            over it); ``dp_world // ep_size`` ranks.
        ep_rank: this rank's index in ``ep_ranks`` (which experts it holds).
        edp_rank: this rank's index in ``edp_ranks``.
        ep_ranks: global ranks of ``ep_group``, ascending.
        edp_ranks: global ranks of ``edp_group``, ascending.
        dp_world: size of the data-parallel group the layout was built in.
    """

    name: str
    ep_size: int
    ep_group: Any
    edp_group: Any
    ep_rank: int
    edp_rank: int
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]
    dp_world: int


def group_name(ep_size: int) -> str:
    """DeepSpeed's name of the groups of ``ep_size``."""
    return f"ep_size_{ep_size}"


def layout(dp_ranks: tuple[int, ...], ep_size: int, data_before_expert: bool = False
           ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """``(ep groups, edp groups)`` of global ranks for one data-parallel group (pure)."""
    world = len(dp_ranks)
    blocks = [dp_ranks[i:i + ep_size] for i in range(0, world, ep_size)]
    strides = [dp_ranks[i::ep_size] for i in range(ep_size)]
    if data_before_expert:
        stride = world // ep_size
        edp = [dp_ranks[i:i + stride] for i in range(0, world, stride)]
        ep = [dp_ranks[i::stride] for i in range(stride)]
        return ep, edp
    return blocks, strides


def check_sizes(num_experts: int, ep_size: int, dp_world: int | None = None) -> None:
    """One-line :class:`UsageError` unless ``ep_size`` divides ``num_experts`` (and the
    data-parallel size, when given)."""
    if ep_size < 1:
        raise UsageError(f"ep_size={ep_size} must be at least 1", where="MoE(ep_size=...)")
    if num_experts % ep_size:
        raise UsageError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}",
                         where="MoE(num_experts=..., ep_size=...)",
                         hint="choose an ep_size that divides num_experts")
    if dp_world is not None and dp_world % ep_size:
        raise UsageError(f"ep_size={ep_size} does not divide the data-parallel size {dp_world}",
                         where="MoE(ep_size=...)",
                         hint="choose an ep_size that divides the data-parallel size")


class ExpertParallelLayer:
    """Base of a module whose experts are spread over an expert-parallel group.

    Its subclass provides ``num_experts``, ``ep_size``, ``expert_groups`` (None until
    :func:`configure` sets them), ``expert_group_name`` and ``set_expert_groups(groups)``.
    """


def moe_layers(module: torch.nn.Module) -> Iterator[Any]:
    """The MoE layers (:class:`ExpertParallelLayer` subclasses) inside ``module``, in
    ``named_modules`` order."""
    for sub in module.modules():
        if isinstance(sub, ExpertParallelLayer):
            yield sub


def configure(module: torch.nn.Module, dp_group: Any = None, *,
              use_data_before_expert_parallel_: bool = False) -> dict[str, ExpertGroups]:
    """Give every MoE layer in ``module`` its :class:`ExpertGroups`, creating the
    process groups once per distinct ``ep_size``; returns them by group name.

    A collective over the ranks of ``dp_group`` only (they call it with the same module
    structure): each rank creates just the groups it belongs to, with torch's
    ``use_local_synchronization``, so ranks outside the data-parallel group (another
    pipeline stage, which may hold no MoE layer) never take part. Layers that already
    hold groups keep them, and when every layer does, nothing is created or communicated
    (idempotent). ``dp_group`` defaults to the whole world.
    Groups are never destroyed (``comm/teardown.py``).
    """
    layers = list(moe_layers(module))
    found: dict[str, ExpertGroups] = {}
    for layer in layers:
        if layer.expert_groups is not None:
            found.setdefault(layer.expert_groups.name, layer.expert_groups)
    wanted = sorted({layer.ep_size for layer in layers
                     if layer.expert_groups is None and group_name(layer.ep_size) not in found})
    if wanted:
        found.update(_create(wanted, dp_group, use_data_before_expert_parallel_))
    for layer in layers:
        if layer.expert_groups is None:
            groups = found[group_name(layer.ep_size)]
            check_sizes(layer.num_experts, layer.ep_size, groups.dp_world)
            layer.set_expert_groups(groups)
    return {name: found[name] for name in sorted({layer.expert_group_name for layer in layers})}


def _create(ep_sizes: list[int], dp_group: Any, data_before_expert: bool
            ) -> dict[str, ExpertGroups]:
    import torch.distributed as dist

    if not dist.is_initialized():
        if dp_group is not None or ep_sizes != [1]:
            raise UsageError(f"MoE layers with ep_size {ep_sizes} need torch.distributed",
                             where="deepshard.runtime.parallel.expert_groups.configure",
                             hint="call deepshard.init_distributed() first")
        return {group_name(1): ExpertGroups(group_name(1), 1, None, None, 0, 0, (0,), (0,), 1)}
    rank = dist.get_rank()
    mine = tuple(sorted(dist.get_process_group_ranks(dp_group))) if dp_group is not None \
        else tuple(range(dist.get_world_size()))
    made = {}
    for ep_size in ep_sizes:
        check_sizes(ep_size, ep_size, len(mine))
        made[group_name(ep_size)] = _create_one(ep_size, mine, rank, data_before_expert)
    return made


def _create_one(ep_size: int, mine: tuple[int, ...], rank: int, data_before_expert: bool
                ) -> ExpertGroups:
    """This rank's groups of ``ep_size``, created by their members only (every member
    creates its edp group, then its ep group: one order, as torch's local
    synchronization needs)."""
    import torch.distributed as dist

    handles: dict[str, tuple[Any, tuple[int, ...]]] = {}
    ep, edp = layout(mine, ep_size, data_before_expert)
    for kind, sets in (("edp", edp), ("ep", ep)):  # DeepSpeed creates edp groups first
        ranks = next(r for r in sets if rank in r)
        group = dist.new_group(list(ranks), use_local_synchronization=True)
        keep(group)  # never destructed: see comm/teardown.py
        handles[kind] = (group, ranks)
    (ep_group, ep_ranks), (edp_group, edp_ranks) = handles["ep"], handles["edp"]
    return ExpertGroups(group_name(ep_size), ep_size, ep_group, edp_group,
                        ep_ranks.index(rank), edp_ranks.index(rank), ep_ranks, edp_ranks,
                        len(mine))


def global_expert_ids(layer: Any) -> list[int]:
    """Global ids of the experts ``layer`` (an ``MoE`` or ``MOELayer``) holds on this
    rank: ``ep_rank * num_local_experts + j`` for local expert ``j``. Before
    :func:`configure` ran, the layer is taken to be expert-parallel rank 0."""
    moe = getattr(layer, "deepspeed_moe", layer)
    ep_rank = moe.expert_groups.ep_rank if moe.expert_groups is not None else 0
    local = moe.num_local_experts
    return [ep_rank * local + j for j in range(local)]


def moe_module_names(module: torch.nn.Module) -> frozenset[str]:
    """Qualified names (``named_modules``) of every module that is, or lies inside, an MoE
    layer: each :class:`~deepshard.moe.sharded_moe.MOELayer` and the ``MoE`` holding it as
    ``deepspeed_moe`` (its residual MLP and coefficient too). AutoTP leaves them whole:
    an MoE layer is replicated over the tensor-parallel group, as DeepSpeed's is without
    expert tensor parallelism."""
    named = list(module.named_modules())
    roots = [name for name, sub in named if isinstance(sub, ExpertParallelLayer)
             or isinstance(getattr(sub, "deepspeed_moe", None), ExpertParallelLayer)]
    return frozenset(name for name, _ in named for root in roots
                     if not root or name == root or name.startswith(f"{root}."))
