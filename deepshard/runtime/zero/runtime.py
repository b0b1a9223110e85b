"""ZeRO stages 1-3 as a data-parallel strategy, composed of parts rather than branching on
the stage: flat groups, a gradient reducer (:class:`~.reducer.GradientReducer`: stage 1's
whole buffers or stage 2's reduce-into-shard), an optional parameter coordinator (stage 3
gathers and releases parameters around each module) and the shard stepper.

:func:`build_zero` builds it from a :class:`~.spec.ZeroSpec` (``deepshard.initialize``
calls it for stages 1-3); :class:`ZeroStrategy` implements
:class:`~deepshard.runtime.strategy.DataParallelStrategy` over the parts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from deepshard.comm import collectives as comm
from deepshard.runtime.buckets import DEFAULT_BUCKET_BYTES
from deepshard.runtime.checkpoint import zero_shards
from deepshard.runtime.checkpoint.by_name import merge_groups
from deepshard.runtime.strategy.base import DataParallelStrategy
from deepshard.runtime.zero.flat import FlatGroup
from deepshard.runtime.zero.init import materialize
from deepshard.runtime.zero.marks import get_z3_leaf_modules
from deepshard.runtime.zero.optimizer import ShardStepper
from deepshard.runtime.zero.partition import layout, pieces, plan_groups
from deepshard.runtime.zero.qgz import QuantizedReduce
from deepshard.runtime.zero.reducer import GradientReducer
from deepshard.runtime.zero.spec import ZeroSpec
from deepshard.runtime.zero.stage1 import Stage1Grads
from deepshard.runtime.zero.stage2 import Stage2Grads
from deepshard.runtime.zero.stage3 import ParamCoordinator, Unit, plan_units
from deepshard.runtime.zero.subgroups import SubGroup, check_size, make_subgroup
from deepshard.runtime.zero.swap import TensorSwapper

if TYPE_CHECKING:
    from deepshard.runtime.checkpoint.by_name import Needed


@dataclass(eq=False)
class ZeroStrategy(DataParallelStrategy):
    """What the engine drives at ZeRO stages 1-3."""

    stage: int  # reported (getters, checkpoints): the parts below decide behaviour
    params: tuple[torch.nn.Parameter, ...]
    names: tuple[str, ...]
    group: dist.ProcessGroup | None
    world: int
    groups: list[FlatGroup]
    grads: GradientReducer
    stepper: ShardStepper
    coordinator: ParamCoordinator | None
    opt_groups: list[list[int]]  # flat group indices per optimizer param group
    frozen_bytes: int  # frozen parameters kept whole (stages 1-2; small ones at stage 3)
    param_swapper: TensorSwapper | None = None
    frozen_groups: list[FlatGroup] = field(default_factory=list)  # stage 3: partitioned
    shards: SubGroup | None = None
    """MiCS: the group the state is sharded over (``None``: the whole ``group``)."""
    replicas: SubGroup | None = None
    """MiCS: the ranks holding the same shards as this one, whose gradients are summed."""
    _replicas_summed: bool = False

    @property
    def shard_group(self) -> dist.ProcessGroup | None:
        """The group the shards are spread over (the data-parallel group but under MiCS)."""
        return self.shards.pg if self.shards is not None else self.group

    @property
    def shard_world(self) -> int:
        return self.shards.size if self.shards is not None else self.world

    @property
    def partitions_params(self) -> bool:
        return self.coordinator is not None

    def gathered_units(self) -> list[torch.nn.Module] | None:
        if self.coordinator is None:
            return None
        return [unit.module for unit in self.coordinator.units]

    # -- backward ---------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        self._replicas_summed = False
        self.grads.begin_backward(boundary)

    def begin_passive(self) -> None:
        self.grads.begin_passive()

    def end_backward(self, boundary: bool) -> None:
        """After autograd: the reducer completes what this backward owes; the coordinator
        releases what it gathered."""
        self.grads.finish_backward(boundary)
        if self.coordinator is not None:
            self.coordinator.end_backward()

    def abort_backward(self) -> None:
        """Autograd raised: drop staged gradients and gathered units, launch nothing more
        (the other ranks' collectives would not match)."""
        self.grads.abort_backward()
        if self.coordinator is not None:
            self.coordinator.end_backward()

    def reduce_now(self) -> None:
        self.grads.reduce_all()

    # -- the step ---------------------------------------------------------------------
    def unscaled_grads(self, inv_scale: float) -> list[torch.Tensor]:
        if self.grads.unreduced:
            self.grads.reduce_all()
        if self.replicas is not None and not self._replicas_summed:
            # MiCS: each shard group reduced its own ranks' gradients; the replicas of a
            # shard add theirs up, once per step
            works = [comm.all_reduce(g, group=self.replicas.pg, async_op=True)
                     for g in self.grads.shard_grads() if g.numel()]
            for work in works:
                work.wait()
            self._replicas_summed = True
        return self.stepper.load_grads(self.grads.shard_grads(), inv_scale)

    def apply_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.stepper.step(optimizer)
        self.stepper.update_model()
        for g in self.groups:
            g.drop_secondary()

    def zero_grad(self) -> None:
        self.grads.zero()

    def excluded_grads(self, grads: Sequence[torch.Tensor],
                       excluded: frozenset[int]) -> list[torch.Tensor]:
        out = []
        for k, g in enumerate(self.groups):
            for pc in pieces(g.flat, g.spec, g.rank):
                if id(self.params[pc.param]) in excluded:
                    out.append(grads[k][pc.shard_start:pc.shard_start + pc.length])
        return out

    def sum_over_data_parallel_(self, square_norm: torch.Tensor) -> None:
        if self.shard_world > 1:  # MiCS: the replicas hold the same shards, counted once
            comm.all_reduce(square_norm, group=self.shard_group)

    def step_tensors(self, opt_group: int) -> list[torch.Tensor]:
        """What the optimizer steps for one of its param groups."""
        return [self.stepper.step_tensors[k] for k in self.opt_groups[opt_group]]

    # -- accounting and lifetime -------------------------------------------------------
    def state_bytes(self, module, optimizer) -> dict[str, int]:
        """Bytes this rank holds between steps (see ``engine.state_bytes``)."""
        del module
        flat = [*self.groups, *self.frozen_groups]
        params = self.frozen_bytes + sum(g.nbytes_params() for g in flat)
        held = self.stepper.nbytes(optimizer)
        nvme = held["nvme"] + sum(g.nbytes_nvme() for g in flat)
        return {"params": params, "grads": self.grads.nbytes(),
                "optimizer": held["optimizer"], "nvme": nvme}

    def close(self) -> None:
        self.grads.remove()
        if self.coordinator is not None:
            self.coordinator.remove()
        self.stepper.close()
        if self.param_swapper is not None:
            self.param_swapper.close()

    # -- checkpoints ------------------------------------------------------------------
    @property
    def master_dtype(self) -> str | None:
        return "torch.float32" if any(self.stepper.separate) else None

    @contextlib.contextmanager
    def materialized(self, optimizer) -> Iterator[None]:
        self.stepper.swap_in_all(optimizer)
        try:
            yield
        finally:
            self.stepper.swap_out_all(optimizer)

    def owned_names(self, module: torch.nn.Module) -> set[str]:
        return zero_shards.owned_names(self, module)

    def masters_by_name(self, module: torch.nn.Module) -> None:
        return None  # in the rank files, with the shards

    def optimizer_state(self, optimizer) -> dict | None:
        if optimizer is None:
            return None
        return {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}

    def optimizer_names(self, optimizer) -> None:
        return None

    def rank_payload(self, optimizer, exclude_frozen: bool = False) -> list[dict]:
        return zero_shards.shard_payload(self, optimizer, exclude_frozen)

    def needed(self) -> Needed:
        return zero_shards.needed(self)

    def restore(self, optimizer, by_name, load_optimizer: bool,
                saved_groups: list[dict]) -> set[str]:
        missing = set(zero_shards.load_into_zero(self, optimizer, by_name, load_optimizer))
        if load_optimizer and optimizer is not None:
            _take_hyperparameters(optimizer, saved_groups)
        return missing

    def same_layout(self, entries: list[dict]) -> bool:
        return zero_shards.same_layout(self, entries)

    def restore_same_layout(self, optimizer, entries: list[dict], load_optimizer: bool,
                            saved_groups: list[dict], peer_entries=None,
                            release=None) -> None:
        zero_shards.load_own(self, optimizer, entries, load_optimizer, peer_entries, release)
        if load_optimizer and optimizer is not None:
            _take_hyperparameters(optimizer, saved_groups)

    def gather_groups(self) -> list[list[torch.nn.Parameter]]:
        if self.coordinator is None:
            return []
        return [g.params for g in (*self.groups, *self.frozen_groups) if g.partitioned]


def _take_hyperparameters(optimizer, saved_groups: list[dict]) -> None:
    """The checkpoint's hyperparameters (lr, betas...) into the optimizer's groups."""
    for g, saved in zip(optimizer.param_groups,
                        merge_groups(optimizer.param_groups, saved_groups), strict=True):
        g.update({k: v for k, v in saved.items() if k != "params"})


QWZ_BLOCK = 256
"""Elements per scale of qwZ's int8 weight gathers: 1.016 bytes per element on the wire
(0.25x fp32's, 0.51x bf16's), each within 1/254 of its block's largest magnitude."""


def build_zero(spec: ZeroSpec, module: torch.nn.Module, names: Sequence[str],
               params: Sequence[torch.nn.Parameter], opt_members: Sequence[Sequence[int]],
               pg: dist.ProcessGroup | None, world: int, rank: int,
               comm_dtype: torch.dtype | None) -> ZeroStrategy:
    """Shard ``params`` (trainable, registration order; ``opt_members`` lists the indices
    of each optimizer param group) the way ``spec`` asks (stages 1-3)."""
    size = params[0].element_size() if params else 4
    # buckets no bigger than DDP's, so that reduction overlaps backward (DeepSpeed's
    # default reduce_bucket_size, 5e8, would make one bucket reduced after backward)
    cap = max(1, min(spec.reduce_bucket_size, DEFAULT_BUCKET_BYTES // size))
    units_plan = plan_units(module, names) if spec.shards_parameters else None
    unit_members: Sequence[Sequence[int]] = ()
    if units_plan is not None:
        index = {n: i for i, n in enumerate(names)}
        unit_members = [[index[n] for n in members] for members in units_plan.params]
    plans = plan_groups([numel_of(p) for p in params], [p.dtype for p in params],
                        opt_members, cap, unit_members, spec.persistence_threshold)
    shards = replicas = None
    if 0 < spec.mics_shard_size < world:
        check_size("mics_shard_size", spec.mics_shard_size, world)
        shards = make_subgroup(pg, world, rank, spec.mics_shard_size)
        replicas = make_subgroup(pg, world, rank, spec.mics_shard_size, strided=True)
    # the state is sharded over the MiCS group where there is one, else over all of pg
    spg, sworld, srank = (shards.pg, shards.size, shards.rank) if shards else (pg, world, rank)
    make = _GroupMaker.from_spec(spec, sworld, srank, spg)
    if spec.quantized_weights:
        make = replace(make, qwz_block=QWZ_BLOCK)
    if spec.hpz_partition_size > 1 and world > 1:
        check_size("zero_hpz_partition_size", spec.hpz_partition_size, world)
        make = replace(make, hpz=make_subgroup(pg, world, rank, spec.hpz_partition_size))
    groups = [make([params[i] for i in plan.params], [names[i] for i in plan.params], plan,
                   f"group{k}") for k, plan in enumerate(plans)]
    frozen_make = replace(make, store_block=QWZ_BLOCK) if spec.quantized_nontrainable else make
    frozen_groups, frozen_units = _frozen_groups(module, params, cap, spec, frozen_make) \
        if units_plan is not None else ([], [])
    materialize(module)  # zero.Init parameters that no group took (small frozen ones)
    coordinator = None
    if units_plan is not None:
        _mark_stage3(module, [*groups, *frozen_groups])
        units = [Unit(u, module.get_submodule(name),
                      [g for g, plan in zip(groups, plans, strict=True) if plan.unit == u],
                      [g for g, fu in zip(frozen_groups, frozen_units, strict=True) if fu == u])
                 for u, name in enumerate(units_plan.modules)]
        coordinator = ParamCoordinator(units, [plan.unit for plan in plans],
                                       spec.prefetch_bucket_size, spec.max_live_parameters,
                                       spec.max_reuse_distance)
    qgz = _qgz_plan(spec, spg, sworld, srank) if spec.quantized_gradients and sworld > 1 \
        else None
    grads = _reducer(spec, params, groups, spg, sworld, comm_dtype, names, cap, coordinator,
                     qgz)
    stepper = ShardStepper(groups, spec.half, spec.offload_optimizer, spg, sworld, srank)
    opt_groups = [[k for k, plan in enumerate(plans) if plan.opt_group == o]
                  for o in range(len(opt_members))]
    trainable = {id(p) for p in params}
    whole = sum(p.numel() * p.element_size() for p in module.parameters()
                if id(p) not in trainable and not hasattr(p, "ds_group"))
    return ZeroStrategy(spec.stage, tuple(params), tuple(names), pg, world, groups, grads,
                        stepper, coordinator, opt_groups, whole, make.swapper,
                        frozen_groups, shards, replicas)


def _mark_stage3(module: torch.nn.Module, groups: Sequence[FlatGroup]) -> None:
    """DeepSpeed's ZeRO-3 parameter attributes tools test for: ``ds_id`` (a number per
    parameter, in the groups' order; OpenRLHF gathers only parameters that have one) and
    ``ds_z3_leaf_module`` (the leaf module a parameter belongs to); ``ds_status``,
    ``ds_tensor``, ``ds_shape`` and ``ds_numel`` are kept by the groups."""
    for number, p in enumerate(p for g in groups for p in g.params):
        p.ds_id = number
    for leaf in get_z3_leaf_modules(module):
        for p in leaf.parameters():
            p.ds_z3_leaf_module = leaf


def _reducer(spec: ZeroSpec, params: Sequence[torch.nn.Parameter], groups: list[FlatGroup],
             pg: dist.ProcessGroup | None, world: int, comm_dtype: torch.dtype | None,
             names: Sequence[str], cap: int, coordinator: ParamCoordinator | None,
             qgz: QuantizedReduce | None = None) -> GradientReducer:
    """Stage 1's whole buffers, or the reduce-into-shard of stages 2-3 (which tells the
    coordinator when a unit's gradients are staged)."""
    if not spec.shards_gradients:
        return Stage1Grads(params, groups, pg, world, comm_dtype, names)
    return Stage2Grads(params, groups, pg, world, comm_dtype, names, spec.overlap_comm, cap,
                       coordinator.on_grads_staged if coordinator else None, qgz)


def _qgz_plan(spec: ZeroSpec, pg: dist.ProcessGroup | None, world: int, rank: int
              ) -> QuantizedReduce:
    """qgZ's two levels: nodes of ``zero_hpz_partition_size`` ranks when given, else of the
    launcher's ranks per node (``LOCAL_WORLD_SIZE``) when every rank has the same count and
    it divides the group; otherwise every rank is its own node (one quantized level)."""
    import os

    per_node = spec.hpz_partition_size if spec.hpz_partition_size > 1 else \
        int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    seen = torch.tensor([per_node, -per_node], dtype=torch.int64)
    comm.all_reduce(seen, op=dist.ReduceOp.MAX, group=pg)
    if int(seen[0]) != -int(seen[1]) or world % per_node:
        per_node = 1
    local = make_subgroup(pg, world, rank, per_node) if per_node > 1 else None
    cross = make_subgroup(pg, world, rank, per_node, strided=True) \
        if per_node < world else None
    return QuantizedReduce(local, cross)


@dataclass(frozen=True)
class _GroupMaker:
    """Builds the flat groups of one engine: where their shards live (``offload_param``)
    and over which ranks."""

    world: int
    rank: int
    pg: dist.ProcessGroup | None
    shard_device: torch.device | None = None
    pin: bool = False
    swapper: TensorSwapper | None = None
    hpz: SubGroup | None = None
    qwz_block: int = 0
    store_block: int = 0

    @classmethod
    def from_spec(cls, spec: ZeroSpec, world: int, rank: int, pg) -> _GroupMaker:
        """Shards on the training device, or where ``offload_param`` puts them."""
        offload = spec.offload_param
        if offload.device not in ("cpu", "nvme"):
            return cls(world, rank, pg)
        swapper = TensorSwapper(cast(str, offload.nvme_path), rank, "params") \
            if offload.device == "nvme" else None
        return cls(world, rank, pg, torch.device("cpu"), bool(offload.pin_memory), swapper)

    def __call__(self, members, member_names, plan, key: str) -> FlatGroup:
        flat = layout(plan.params, [numel_of(p) for p in members])
        g = FlatGroup(members, member_names, flat, self.world, self.rank, self.pg,
                      plan.partitioned, shard_device=self.shard_device, pin_memory=self.pin,
                      swapper=self.swapper, key=key, hpz=self.hpz,
                      qwz_block=self.qwz_block, store_block=self.store_block)
        for p in g.params:
            p.ds_group = g
        return g


def _frozen_groups(module: torch.nn.Module, params: Sequence[torch.nn.Parameter], cap: int,
                   spec: ZeroSpec, make: _GroupMaker) -> tuple[list[FlatGroup], list[int | None]]:
    """Stage 3's partitioned groups of frozen parameters and the unit of each (those under
    the persistence threshold stay whole on every rank)."""
    names, frozen = _frozen(module, params)
    index = {n: i for i, n in enumerate(names)}
    members = [[index[n] for n in unit] for unit in plan_units(module, names).params]
    plans = [plan for plan in plan_groups(
        [numel_of(p) for p in frozen], [p.dtype for p in frozen], [list(range(len(frozen)))],
        cap, members, spec.persistence_threshold) if plan.partitioned]
    groups = [make([frozen[i] for i in plan.params], [names[i] for i in plan.params], plan,
                   f"frozen{k}") for k, plan in enumerate(plans)]
    return groups, [plan.unit for plan in plans]


def numel_of(p: torch.nn.Parameter) -> int:
    """Elements of ``p`` (its full size when built under ``zero.Init``: empty then)."""
    return getattr(p, "ds_numel", None) or p.numel()


def _frozen(module: torch.nn.Module, trained: Sequence[torch.nn.Parameter]
            ) -> tuple[list[str], list[torch.nn.Parameter]]:
    """The module's frozen parameters (``requires_grad`` off), by name in registration
    order."""
    ids = {id(p) for p in trained}
    named = [(n, p) for n, p in module.named_parameters()
             if id(p) not in ids and not p.requires_grad]
    return [n for n, _ in named], [p for _, p in named]
