"""A deepshard run saved in DeepSpeed 0.19.8's own layout (``checkpoint.format:
"deepspeed"``), so DeepSpeed loads and continues it at the same world size and stage (and
deepshard at any, as any DeepSpeed checkpoint).

What is written is what DeepSpeed writes: ``mp_rank_00_model_states.pt`` (stages 0-2; the
module, the parameter shapes of each flat group, the scheduler, the counters, the config
and the ``client_state`` at the top level) or one ``zero_pp_rank_R_mp_rank_00_model_states
.pt`` per rank (stage 3: buffers whole, this rank's pieces of the frozen parameters), and
per rank ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` holding its fp32 partition of
every flat group and the optimizer state over it (:mod:`.ds_layout` says where each
parameter lies). At stages 1-2 a DeepSpeed partition is this rank's shard give or take a
few elements at its edges, which the ranks exchange; at stage 3 (every parameter cut into
pieces) each rank gathers one of deepshard's flat groups at a time (its values, then each
optimizer state tensor) and cuts its pieces out of it, so the extra memory of a save is
one flat group, whole. The tag directory appears at once (:func:`.format.write_tag`),
with ``latest`` pointing at it.

Written: data-parallel jobs at ZeRO 0 (fp32) and 1-3 (fp32, bf16). Refused in one line:
pipeline / tensor parallel jobs, MoE, fp16, bf16 at stage 0, the 1-bit optimizers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deepshard.comm import collectives as comm
from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import ds_files, ds_layout, ds_pickle
from deepshard.runtime.checkpoint import format as fmt
from deepshard.runtime.checkpoint.by_name import aliases
from deepshard.runtime.checkpoint.universal import WRITTEN_VERSION
from deepshard.runtime.strategy.stage0 import Stage0Strategy
from deepshard.runtime.zero.runtime import ZeroStrategy

VALUES = ""
"""The kind of the fp32 values in :class:`Part` (beside each optimizer state's key)."""
WHERE = "checkpoint.format"


@dataclass
class Part:
    """This rank's DeepSpeed partition of one flat group being filled: fp32 values, each
    optimizer state tensor, the optimizer's scalars (``step``), and where each parameter's
    fragment lies in it (stages 1-2: ``param_slice_mappings``)."""

    layout: ds_layout.Partitioned
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)
    fragments: dict[str, tuple[int, int]] = field(default_factory=dict)

    def buffer(self, kind: str, like: torch.Tensor) -> torch.Tensor:
        """The partition's tensor of ``kind`` (zeros at first: DeepSpeed's padding)."""
        if kind not in self.tensors:
            dtype = torch.float32 if kind == VALUES else like.dtype
            self.tensors[kind] = torch.zeros(self.layout.size, dtype=dtype)
        return self.tensors[kind]

    def put(self, kind: str, member: int, flat: torch.Tensor, rank: int, world: int,
            stage3: bool) -> None:
        """Copy this rank's part of one whole (flattened) parameter in."""
        lay = self.layout
        at, n = lay.offsets[member], lay.numels[member]
        if stage3:
            cut = ds_layout.piece(n, world)
            src = flat[rank * cut:min((rank + 1) * cut, n)]
            if src.numel():
                self.buffer(kind, flat)[at:at + src.numel()] = src
            return
        lo, hi = max(at, lay.start), min(at + n, lay.start + lay.size)
        if lo >= hi:
            return
        self.buffer(kind, flat)[lo - lay.start:hi - lay.start] = flat[lo - at:hi - at]
        if kind == VALUES:
            self.fragments[lay.names[member]] = (hi - lo, lo - lay.start)


def check(engine) -> None:
    """Refuse (one line) a job whose state DeepSpeed's layout cannot hold."""
    strategy = engine.strategy
    said = None
    if engine.topology is not None:
        said = "a pipeline / tensor-parallel job"
    elif type(strategy) not in (Stage0Strategy, ZeroStrategy):  # not their subclasses
        said = f"a job with {type(strategy).__name__} (MoE, 1-bit optimizers)"
    elif getattr(strategy, "replicas", None) is not None:
        said = "a MiCS job (mics_shard_size)"
    elif engine.loss_scaler is not None and getattr(engine.loss_scaler, "dynamic", False):
        said = "an fp16 job (its dynamic loss scale)"
    elif _dtype(engine) == torch.float16:
        said = "an fp16 job"
    elif strategy.stage == 0 and _dtype(engine) != torch.float32:
        said = "a bf16 job at ZeRO stage 0"
    if said is not None:
        raise UsageError(f"DeepSpeed's checkpoint layout is not written for {said} yet",
                         where=WHERE,
                         hint="save in deepshard's format (remove checkpoint.format) and "
                              "convert it with ds_to_universal, which DeepSpeed loads")


def _dtype(engine) -> torch.dtype:
    params = engine.strategy.params
    return params[0].dtype if params else torch.float32


def files(engine, client_state: Mapping | None, exclude_frozen: bool) -> dict[str, Any]:
    """This rank's files of a DeepSpeed checkpoint, by name (collective)."""
    strategy, optimizer = engine.strategy, engine.optimizer
    world, rank = engine.dp_world_size, engine.global_rank
    if strategy.stage == 0:
        if rank != 0:
            return {}
        model = _model(engine, client_state, exclude_frozen, [], None)
        model["optimizer"] = _optim0(strategy, optimizer) if optimizer is not None else None
        for key in ("param_shapes", "frozen_param_shapes", "shared_params",
                    "frozen_param_fragments"):
            model[key] = None
        return {ds_files.model_file(): model}
    stage3 = strategy.stage == 3
    names = _canonical(engine.module)
    plan = _plan(engine, names, world, rank)
    parts = _fill(strategy, optimizer, plan, names, world, rank, stage3)
    # DeepSpeed keeps frozen parameters beside the module from stage 2 on
    keep = strategy.stage >= 2 and not exclude_frozen
    frozen = _frozen(engine, names, world, rank, stage3) if keep else None
    model = _model(engine, client_state, exclude_frozen, plan, frozen)
    out: dict[str, Any] = {}
    if stage3:
        out[ds_files.zero3_model_file(rank)] = model
    elif rank == 0:
        out[ds_files.model_file()] = model
    optim = _optim3(engine, parts) if stage3 else _optim12(engine, parts, world)
    bf16 = _dtype(engine) == torch.bfloat16
    out[ds_files.optim_file(rank, bf16=bf16)] = {
        "optimizer_state_dict": optim, "ds_config": dict(engine.config),
        "ds_version": WRITTEN_VERSION}
    return out


def save(engine, save_dir, tag: str, client_state: Mapping | None, save_latest: bool,
         exclude_frozen: bool) -> None:
    """Write the checkpoint (every rank calls this): atomically, ``latest`` updated
    unless ``save_latest`` is false."""
    check(engine)
    with engine.strategy.materialized(engine.optimizer):
        mine = files(engine, client_state, exclude_frozen)
    fmt.write_tag(save_dir, tag, rank=engine.global_rank, files=mine, agree=engine.agree,
                  save_latest=save_latest, pickle_module=ds_pickle.pickle_module())


# -- where each parameter goes ---------------------------------------------------------
def _canonical(module: torch.nn.Module) -> dict[int, str]:
    """Each parameter's first name (DeepSpeed names a tied parameter so)."""
    out: dict[int, str] = {}
    for name, p in module.named_parameters():
        out.setdefault(id(p), name)
    return out


def _user_groups(engine) -> list[list[torch.nn.Parameter]]:
    """The trainable parameters of each of the user's optimizer groups, in order."""
    by_name = dict(engine.module.named_parameters(remove_duplicate=False))
    groups = engine.strategy.optimizer_groups
    if groups is None:
        groups = (tuple(by_name),)
    out = []
    for names in groups:
        seen: set[int] = set()
        members = []
        for n in names:
            p = by_name.get(n)
            if p is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                members.append(p)
        out.append(members)
    return out


def _plan(engine, names: Mapping[int, str], world: int, rank: int
          ) -> list[ds_layout.Partitioned]:
    """This rank's DeepSpeed partitions: one per group (stages 1-2), one per sub-group
    (stage 3); ``names``: each parameter's first name (:func:`_canonical`)."""
    given = engine.config.get("zero_optimization") or {}
    plan: list[ds_layout.Partitioned] = []
    for i, members in enumerate(_user_groups(engine)):
        if not members:
            continue
        group_names = [names[id(p)] for p in members]
        numels = [int(getattr(p, "ds_numel", None) or p.numel()) for p in members]
        if engine.strategy.stage == 3:
            plan.extend(ds_layout.stage3(group_names, numels, world, i,
                                         int(given.get("sub_group_size",
                                                       ds_layout.SUB_GROUP_SIZE))))
        else:
            size = torch.empty(0, dtype=members[0].dtype).element_size()
            plan.append(ds_layout.stage12(group_names, numels, world, rank, i, size,
                                          bool(given.get("parameter_alignment", False))))
    return plan


@torch.no_grad()
def _fill(zero, optimizer, plan: list[ds_layout.Partitioned], names: Mapping[int, str],
          world: int, rank: int, stage3: bool) -> list[Part]:
    """Gather deepshard's flat groups one at a time and copy this rank's DeepSpeed
    partitions out of them (``names``: each parameter's first name, by ``id``)."""
    parts = [Part(p) for p in plan]
    where = {n: (i, k) for i, p in enumerate(plan) for k, n in enumerate(p.names)}
    for k, g in enumerate(zero.groups):
        t = zero.stepper.step_tensors[k]
        state = optimizer.state.get(t, {}) if optimizer is not None else {}
        members = [names[id(p)] for p in g.params]
        kinds = {VALUES: t, **{key: v for key, v in state.items()
                               if torch.is_tensor(v) and v.dim() > 0}}
        same = None if stage3 else _same_flat(g, members, plan, where)
        for kind, shard in kinds.items():
            if same is not None:
                _from_edges(parts[same], kind, shard, g, world, rank)
                continue
            full = _gathered(shard, g, world)
            for j, name in enumerate(members):
                if name in where:
                    i, m = where[name]
                    off, n = g.flat.offsets[j], g.flat.numels[j]
                    parts[i].put(kind, m, full[off:off + n], rank, world, stage3)
            del full
        scalars = {key: v for key, v in state.items() if not (torch.is_tensor(v) and v.dim())}
        for name in members:
            if name in where and scalars:
                parts[where[name][0]].scalars = dict(scalars)
    return parts


def _same_flat(g, members: list[str], plan: list[ds_layout.Partitioned],
               where: Mapping[str, tuple[int, int]]) -> int | None:
    """The DeepSpeed group laid out as deepshard's flat group ``g`` (the same members in
    the same order, no alignment padding), if any: then their partitions differ only
    by the few elements at each edge."""
    if not members or members[0] not in where:
        return None
    i, first = where[members[0]]
    lay = plan[i]
    same = first == 0 and list(lay.names) == members and not any(lay.paddings) and \
        list(lay.offsets) == list(g.flat.offsets)
    return i if same else None


def _from_edges(part: Part, kind: str, shard: torch.Tensor, g, world: int, rank: int) -> None:
    """This rank's DeepSpeed partition of a group laid out as deepshard's flat group
    ``g`` (:func:`_same_flat`): its own shard and the first elements of the next ranks'.
    DeepSpeed pads a group to ``2 × world`` elements, deepshard to ``world``: partition
    ``r`` is ``[rP, (r+1)P)`` with ``P - S`` (``S`` deepshard's shard) 0 or 1, so it
    reaches at most ``r + 1 ≤ world`` elements into shard ``r + 1`` (or, with shards
    shorter than ``world``, whole ones). Collective: every rank gathers those heads."""
    src = shard.detach().reshape(-1).cpu()
    size = g.spec.shard
    head = min(world, size)
    heads = _gathered(src[:head], g, world).view(world, head) if world > 1 else src[None, :head]
    lay = part.layout
    out = part.buffer(kind, src)
    for k in range(world):
        lo, hi = max(lay.start, k * size), min(lay.start + lay.size, (k + 1) * size)
        if lo >= hi:
            continue
        piece = src if k == rank else heads[k]
        if hi - k * size > piece.numel():  # DeepSpeed's padding rule changed: a bug here
            raise RuntimeError(f"DeepSpeed partition {rank} reaches {hi - k * size} "
                               f"elements into shard {k}; {piece.numel()} gathered")
        out[lo - lay.start:hi - lay.start] = piece[lo - k * size:hi - k * size]
    if kind == VALUES:
        for name, at, n in zip(lay.names, lay.offsets, lay.numels, strict=True):
            lo, hi = max(at, lay.start), min(at + n, lay.start + lay.size)
            if lo < hi:
                part.fragments[name] = (hi - lo, lo - lay.start)


def _gathered(shard: torch.Tensor, g, world: int) -> torch.Tensor:
    """Every rank's shard of one flat group, end to end (on the CPU)."""
    src = shard.detach().reshape(-1)
    if world == 1:
        return src.cpu()
    out = torch.empty(src.numel() * world, dtype=src.dtype, device=src.device)
    comm.all_gather_into_tensor(out, src.contiguous(), group=g.pg)
    return out.cpu()


@torch.no_grad()
def _frozen(engine, names: Mapping[int, str], world: int, rank: int,
            stage3: bool) -> dict[str, torch.Tensor]:
    """The frozen parameters DeepSpeed keeps beside the module: whole (stages 1-2), or
    this rank's piece of each (stage 3). Collective at stage 3 (partitioned ones are
    gathered)."""
    zero = engine.strategy
    whole: dict[str, torch.Tensor] = {}
    if stage3:
        for g in zero.frozen_groups:
            full = _gathered(g.read_shard(), g, world)
            for j, p in enumerate(g.params):
                off, n = g.flat.offsets[j], g.flat.numels[j]
                whole[names[id(p)]] = full[off:off + n].view(tuple(g.shapes[j]))
    out: dict[str, torch.Tensor] = OrderedDict()
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            continue
        value = whole.get(name)
        if value is None:
            value = p.detach().cpu()
        if stage3:
            cut = ds_layout.piece(value.numel(), world)
            piece = torch.zeros(cut, dtype=value.dtype)
            src = value.reshape(-1)[rank * cut:(rank + 1) * cut]
            piece[:src.numel()] = src
            value = piece
        out[name] = value.clone()
    return out


# -- the files -------------------------------------------------------------------------
def _model(engine, client_state: Mapping | None, exclude_frozen: bool,
           plan: Sequence[ds_layout.Partitioned], frozen: Mapping[str, torch.Tensor] | None
           ) -> dict:
    """The model states file: DeepSpeed's keys, then the client state's."""
    module = engine.module
    stage3 = engine.strategy.stage == 3
    params = {n: p for n, p in module.named_parameters()}
    state = module.state_dict()
    if stage3:  # DeepSpeed's stage 3 module file holds empty parameters
        state = OrderedDict((n, torch.empty(0, dtype=params[n].dtype) if n in params else v)
                            for n, v in state.items())
    if exclude_frozen:
        state = OrderedDict((n, v) for n, v in state.items()
                            if not (n in params and not params[n].requires_grad))
    buffers = {n for n, _ in module.named_buffers()}
    shapes: list[OrderedDict] = []
    for p in plan:
        if p.group >= len(shapes):
            shapes.extend(OrderedDict() for _ in range(p.group + 1 - len(shapes)))
        shapes[p.group].update((n, params[n].ds_shape if hasattr(params[n], "ds_shape")
                                else params[n].shape) for n in p.names)
    counters = engine.counters
    return {
        "module": state,
        "buffer_names": [n for n in state if n in buffers],
        "optimizer": None,
        "param_shapes": [s for s in shapes if s],
        "frozen_param_shapes": None if frozen is None else OrderedDict(
            (n, getattr(params[n], "ds_shape", None) or params[n].shape) for n in frozen),
        "shared_params": aliases(module),  # a tied parameter's other names → its first
        "frozen_param_fragments": None if frozen is None else OrderedDict(frozen),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": counters.skipped_steps,
        "global_steps": counters.global_steps,
        "global_samples": counters.global_samples,
        "dp_world_size": engine.dp_world_size,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": dict(engine.config),
        "ds_version": WRITTEN_VERSION,
        **dict(client_state or {}),
    }


def _hyper(optimizer, group: int) -> dict:
    if optimizer is None or group >= len(optimizer.param_groups):
        return {}
    return {k: v for k, v in optimizer.param_groups[group].items() if k != "params"}


def _state(part: Part) -> dict:
    return {**{k: v.clone() if torch.is_tensor(v) else v for k, v in part.scalars.items()},
            **{k: v for k, v in part.tensors.items() if k != VALUES}}


def _common() -> dict:
    return {
        "loss_scaler": ds_pickle.instance(ds_pickle.LOSS_SCALER, cur_scale=1.0,
                                          dynamic=False),
        "dynamic_loss_scale": False,
        "overflow": False,
    }


def _optim0(strategy, optimizer) -> dict:
    """Stage 0: the optimizer's ``state_dict`` with DeepSpeed's positions: every
    parameter of each of the user's groups, frozen ones included (DeepSpeed's optimizer
    holds them; deepshard's steps only the trainable ones)."""
    saved = optimizer.state_dict()
    names = strategy.optimizer_names(optimizer)
    by_name = {names[pos]: st for pos, st in saved["state"].items()}
    groups = strategy.optimizer_groups or (tuple(names),)
    state: dict[int, dict] = {}
    param_groups: list[dict] = []
    at = 0
    for i, members in enumerate(groups):
        hyper = saved["param_groups"][min(i, len(saved["param_groups"]) - 1)]
        positions = list(range(at, at + len(members)))
        state.update((pos, by_name[n]) for pos, n in zip(positions, members, strict=True)
                     if n in by_name)
        param_groups.append({**{k: v for k, v in hyper.items() if k != "params"},
                             "params": positions})
        at += len(members)
    return {"state": state, "param_groups": param_groups}


def _optim12(engine, parts: list[Part], world: int) -> dict:
    """A stage 1-2 rank's ``optimizer_state_dict`` (``DeepSpeedZeroOptimizer.state_dict``)."""
    state = {i: _state(p) for i, p in enumerate(parts) if len(p.tensors) > 1}
    groups = [{**_hyper(engine.optimizer, p.layout.group), "params": [i]}
              for i, p in enumerate(parts)]
    stage = ds_pickle.instance(ds_pickle.ZERO_STAGE, engine.strategy.stage)
    return {
        **_common(),
        "clip_grad": float(engine.gradient_clipping() or 0.0),
        "base_optimizer_state": {"state": state, "param_groups": groups},
        "single_partition_of_fp32_groups": [
            p.buffer(VALUES, torch.empty(0))[:p.layout.size - p.layout.padding].clone()
            for p in parts],
        "zero_stage": stage,
        "group_paddings": [p.layout.padding for p in parts],
        "param_alignment_paddings": [list(p.layout.paddings) for p in parts],
        "partition_count": [world] * len(parts),
        "ds_version": WRITTEN_VERSION,
        "param_slice_mappings": [
            OrderedDict((n, ds_pickle.instance(ds_pickle.FRAGMENT_ADDRESS, numel=numel,
                                               start=start))
                        for n, (numel, start) in p.fragments.items()) for p in parts],
    }


def _optim3(engine, parts: list[Part]) -> dict:
    """A stage 3 rank's ``optimizer_state_dict`` (``DeepSpeedZeroOptimizer_Stage3``)."""
    state = {i: _state(p) for i, p in enumerate(parts) if len(p.tensors) > 1}
    groups: dict[int, dict] = {}
    for i, p in enumerate(parts):
        entry = groups.setdefault(p.layout.group,
                                  {**_hyper(engine.optimizer, p.layout.group), "params": []})
        entry["params"].append(i)
    return {
        "zero_stage": ds_pickle.instance(ds_pickle.ZERO_STAGE, 3),
        **_common(),
        "partition_count": engine.dp_world_size,
        "optimizer_state_dict": {"state": state, "param_groups": list(groups.values())},
        "fp32_flat_groups": [p.buffer(VALUES, torch.empty(0)) for p in parts],
    }
