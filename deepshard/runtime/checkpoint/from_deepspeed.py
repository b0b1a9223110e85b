"""A DeepSpeed checkpoint (any ZeRO stage, fp32 / fp16 / bf16) read into deepshard's
by-name form, so ``load_checkpoint`` and the consolidation read it as they read deepshard's
own, at any world size and stage.

DeepSpeed keeps fp32 masters and optimizer state as flat partitions: at stages 1-2 each
group's parameters lie end to end (in ``param_shapes`` order) across the ranks' partitions
one after the other; at stage 3 every parameter is cut into ``ceil(numel / world)`` pieces,
rank ``r`` holding piece ``r`` of each, in order. Stage 0 keeps whole tensors by optimizer
position; its positions are named by the loading job's optimizer groups (DeepSpeed's own
load matches them by position too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import ds_files
from deepshard.runtime.checkpoint import format as fmt
from deepshard.runtime.checkpoint.by_name import ByName, Needed, in_order

DEEPSPEED_STATES = ("module", "skipped_steps", "global_steps", "dp_world_size",
                    "mp_world_size", "data_sampler", "random_ltd")
"""Keys DeepSpeed's ``load_checkpoint`` keeps out of the ``client_state`` it returns (with
``lr_scheduler`` / ``optimizer`` when it loads them)."""


@dataclass
class Loaded:
    """A DeepSpeed checkpoint as deepshard's load takes it: a manifest and a shared dict
    of deepshard's shape, the values and optimizer state by name, and the model file's
    top level (for the ``client_state`` DeepSpeed would return)."""

    manifest: fmt.Manifest
    shared: dict
    by_name: ByName
    top: dict


def read(tag_dir: Path, position_names: Sequence[Sequence[str]] | None = None,
         frozen: frozenset[str] = frozenset(), need: Needed | None = None) -> Loaded:
    """The DeepSpeed checkpoint in ``tag_dir``. ``position_names``: the names of the
    loading job's optimizer groups, in order, frozen ones (``frozen``) included, which
    name a stage 0 checkpoint's optimizer positions (default: the checkpoint's
    parameters in module order, matched by shape). ``need``: assemble only these names'
    values and state from the ZeRO partitions (default: all).

    Raises:
        UsageError: a missing or extra rank file, files of another world size, or state
            that does not fit the shapes recorded (one line naming the file).
    """
    found = ds_files.files(tag_dir)
    top = _top(found)
    world = int(top.get("dp_world_size") or 1)
    stage = _stage(found)
    if stage and len(found.optim) != world:
        raise UsageError(f"{len(found.optim)} optimizer partition files for a world of "
                         f"{world} ranks", where=str(tag_dir),
                         hint="copy the whole tag directory (one optimizer file per rank); "
                              "files of two saves must not be mixed")
    if stage == 3 and len(found.model) != world:
        raise UsageError(f"{len(found.model)} stage 3 model files for a world of {world} "
                         "ranks", where=str(tag_dir),
                         hint="copy the whole tag directory (one model file per rank)")
    module = _module(found, top)
    if stage == 0:
        out, groups, scaler = _stage0(top, module, position_names, frozen, tag_dir)
    else:
        optims = [ds_files.load(p)["optimizer_state_dict"] for p in found.optim]
        shapes = top["param_shapes"] or []
        if stage == 3:
            out = _stage3(optims, shapes, world, found, need)
        else:
            out = _stage12(optims, shapes, found, need)
        for name, value in module.items():
            out.values.setdefault(name, value)
        groups = _param_groups(optims[0])
        scaler = scaler_state(optims[0].get("loss_scaler"), optims[0])
    for alias, canonical in (top.get("shared_params") or {}).items():
        if canonical in out.values:
            out.values[alias] = out.values[canonical]
    out.present.update(out.values)
    return loaded(tag_dir, top, out, stage, groups, scaler, found)


def loaded(tag_dir: Path, top: Mapping[str, Any], out: ByName, stage: int,
           groups: list[dict], scaler: dict | None, found: ds_files.Files) -> Loaded:
    """:class:`Loaded` from what was read: the model file's top level ``top``, the
    values and state by name, the stage, the optimizer's param groups and loss scale."""
    world = int(top.get("dp_world_size") or 1)
    module = top.get("module") or {}
    manifest = fmt.Manifest(
        tag=tag_dir.name, world_size=world, zero_stage=stage,
        param_dtype=str(_param_dtype(module)), master_dtype="torch.float32",
        global_steps=int(top.get("global_steps", 0)), deepshard_version="deepspeed " +
        str(top.get("ds_version", "?")), files=tuple(p.name for p in (*found.model,
                                                                     *found.optim)),
        frozen_excluded=True)
    gas = int((top.get("ds_config") or {}).get("gradient_accumulation_steps") or 1)
    steps = int(top.get("global_steps", 0))
    shared = {
        "module": {},
        "optimizer": {"state": {}, "param_groups": groups} if groups else None,
        "lr_scheduler": top.get("lr_scheduler"),
        "loss_scaler": scaler,
        "counters": {"global_steps": steps, "micro_steps": steps * gas,
                     "skipped_steps": int(top.get("skipped_steps", 0)),
                     "global_samples": int(top.get("global_samples", 0))},
        "data_position": None,
    }
    return Loaded(manifest, shared, out, dict(top))


def consolidated(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The whole model state of a DeepSpeed checkpoint (fp32 masters where kept), in the
    order of its module's state dict (DeepSpeed's ``zero_to_fp32`` order)."""
    loaded = read(tag_dir)
    return in_order(loaded.by_name.values, list(loaded.top.get("module") or {}))


def frozen_names(tag_dir: Path) -> set[str]:
    """The parameters a DeepSpeed checkpoint holds that did not train: stage 3 records
    them; elsewhere they are the module's entries that are neither buffers nor in the
    optimizer's ``param_shapes`` (stage 0 keeps none apart: nothing is frozen there)."""
    top = read(tag_dir).top
    if top.get("frozen_param_shapes"):
        return set(top["frozen_param_shapes"])
    shapes = top.get("param_shapes")
    if not shapes:
        return set()
    trained = {n for g in shapes for n in g} | set(top.get("buffer_names") or ())
    trained |= set(top.get("shared_params") or {})
    return {n for n in top.get("module") or {} if n not in trained}


def check_optimizer(top: Mapping[str, Any], where: Path) -> None:
    """Refuse, in one line, optimizer state of a DeepSpeed optimizer deepshard lacks (its
    config's ``optimizer.type``), before anything is loaded.

    Raises:
        UsageError: naming the optimizer, with ``load_optimizer_states=False`` as the way on.
    """
    from deepshard.config.schema_optim import OptimizerConfig

    kind = ((top.get("ds_config") or {}).get("optimizer") or {}).get("type")
    if isinstance(kind, str) and OptimizerConfig.params_model(kind) is None:
        raise UsageError(f"this DeepSpeed checkpoint holds the state of optimizer {kind!r}, "
                         "which deepshard does not have", where=str(where),
                         hint="load it with load_optimizer_states=False: the weights, "
                              "schedule and counters still load (the optimizer starts afresh)")


def client_state(top: Mapping[str, Any], load_optimizer: bool,
                 load_lr_scheduler: bool) -> dict:
    """What DeepSpeed's ``load_checkpoint`` returns as client state for this model file:
    everything but its own states (the client's keys, and DeepSpeed's metadata)."""
    skip = set(DEEPSPEED_STATES)
    skip.update(("lr_scheduler",) if load_lr_scheduler else ())
    skip.update(("optimizer",) if load_optimizer else ())
    return {k: v for k, v in top.items() if k not in skip}


def _top(found: ds_files.Files) -> dict:
    return ds_files.load(found.model[0])


def _stage(found: ds_files.Files) -> int:
    if not found.optim:
        return 0
    first = ds_files.load(found.optim[0])["optimizer_state_dict"]
    stage = first.get("zero_stage")
    value = getattr(stage, "value", stage)
    if value is None:  # bf16 at stage 0 (DeepSpeed's BF16_Optimizer) keeps its own files
        return 0
    return int(value)


def _module(found: ds_files.Files, top: Mapping) -> dict[str, torch.Tensor]:
    """The module's entries worth keeping (stage 3 saves its parameters empty)."""
    del found
    shapes = {n for g in top.get("param_shapes") or [] for n in g}
    shapes.update(top.get("frozen_param_shapes") or {})
    return {n: v for n, v in (top.get("module") or {}).items()
            if not (n in shapes and v.numel() == 0)}


def _param_dtype(module: Mapping[str, torch.Tensor]) -> torch.dtype:
    floats = [v.dtype for v in module.values() if torch.is_floating_point(v)]
    return max(set(floats), key=floats.count) if floats else torch.float32


# -- stage 0 ---------------------------------------------------------------------------
def _stage0(top: Mapping, module: dict[str, torch.Tensor],
            position_names: Sequence[Sequence[str]] | None, frozen: frozenset[str],
            tag_dir: Path) -> tuple[ByName, list[dict], dict | None]:
    out = ByName(dict(module))
    opt = top.get("optimizer")
    if not opt:
        return out, [], None
    inner = opt.get("optimizer_state_dict", opt) if isinstance(opt, Mapping) else {}
    groups = [dict(g) for g in inner.get("param_groups", [])]
    counts = [len(g.get("params", ())) for g in groups]
    state = inner.get("state") or {}
    masters = opt.get("fp32_groups")
    if position_names is not None:
        names = _stage0_names(position_names, frozen, counts, tag_dir)
    else:
        names = _guess_names(module, top.get("buffer_names") or (), counts, masters, state,
                             tag_dir)
    masters = masters or _split_flat(opt.get("fp32_groups_flat"), names, counts, module)
    pos = 0
    for g, count in enumerate(counts):
        for i in range(count):
            name = names[pos + i]
            if masters:
                out.values[name] = _fit(masters[g][i], module, name, tag_dir)
        pos += count
    for p, entry in state.items():
        name = names[int(p)]
        out.state[name] = {k: _fit(v, module, name, tag_dir) for k, v in entry.items()
                           if torch.is_tensor(v) and v.dim() > 0}
        out.scalars[name] = {k: v for k, v in entry.items()
                             if not (torch.is_tensor(v) and v.dim() > 0)}
    return out, groups, scaler_state(opt.get("loss_scaler"), opt)


def _stage0_names(position_names: Sequence[Sequence[str]], frozen: frozenset[str],
                  counts: list[int], tag_dir: Path) -> list[str]:
    """The loading job's names by position: all of its groups' parameters (a torch
    optimizer keeps frozen ones), else the trainable ones only (DeepSpeed's fp16 / bf16
    wrappers leave the frozen out)."""
    trainable = [[n for n in g if n not in frozen] for g in position_names]
    for groups in (position_names, trainable):
        if [len(g) for g in groups] == counts:
            return [n for g in groups for n in g]
    have = ", ".join(str(len(g)) for g in position_names) or "none"
    raise UsageError(f"the checkpoint's optimizer has {len(counts)} param group(s) of "
                     f"{', '.join(map(str, counts))} parameters; this job's has {have}",
                     where=str(tag_dir / ds_files.model_file()),
                     hint="build the optimizer with the same param groups as the job that "
                          "saved it, or pass load_optimizer_states=False")


def _guess_names(module: Mapping[str, torch.Tensor], buffers: Sequence[str],
                 counts: Sequence[int], masters: Sequence[Sequence[torch.Tensor]] | None,
                 state: Mapping, tag_dir: Path) -> list[str]:
    """Without a job's optimizer (consolidation), a stage 0 checkpoint's positions are
    its parameters in module order, skipping those whose shape does not fit (frozen)."""
    total = sum(counts)
    shapes: list[torch.Size | None] = [None] * total
    if masters:
        shapes = [m.shape for group in masters for m in group]
    for p, entry in state.items():
        tensor = next((v for v in entry.values() if torch.is_tensor(v) and v.dim() > 0), None)
        if tensor is not None and int(p) < total:
            shapes[int(p)] = tensor.shape
    candidates = iter(n for n in module if n not in set(buffers))
    names = []
    for shape in shapes:
        name = next((n for n in candidates if shape is None or module[n].shape == shape),
                    None)
        if name is None:
            raise UsageError("cannot tell which parameter each optimizer position of this "
                             "stage 0 checkpoint holds", where=str(tag_dir),
                             hint="load it into an engine whose optimizer has the saving "
                                  "job's param groups")
        names.append(name)
    return names


def _split_flat(flats: Sequence[torch.Tensor] | None, names: Sequence[str],
                counts: Sequence[int], module: Mapping[str, torch.Tensor]
                ) -> list[list[torch.Tensor]] | None:
    """fp16 at stage 0 keeps one flat fp32 tensor per group."""
    if not flats:
        return None
    out, pos = [], 0
    for flat, count in zip(flats, counts, strict=True):
        parts, off = [], 0
        for name in names[pos:pos + count]:
            n = module[name].numel()
            parts.append(flat[off:off + n].view(module[name].shape))
            off += n
        out.append(parts)
        pos += count
    return out


def _fit(value: torch.Tensor, module: Mapping[str, torch.Tensor], name: str,
         tag_dir: Path) -> torch.Tensor:
    want = module[name].shape if name in module else value.shape
    if value.shape != want:
        raise UsageError(f"optimizer state for {name} has shape {tuple(value.shape)}, the "
                         f"parameter {tuple(want)}", where=str(tag_dir),
                         hint="build the optimizer with the same param groups (same order) "
                              "as the job that saved it, or pass load_optimizer_states=False")
    return value


# -- stages 1-3 ------------------------------------------------------------------------
def _group_states(optims: Sequence[Mapping], g: int
                  ) -> tuple[dict[str, list[torch.Tensor]], dict[str, Any]]:
    """Group ``g``'s flat optimizer state: each state tensor's partition in every rank's
    file (rank order), and the group's scalars (``step``) from rank 0's."""
    states = []
    for opt in optims:
        base = opt.get("base_optimizer_state", opt.get("optimizer_state_dict"))
        if isinstance(base, list):  # elastic_checkpoint: one dict per group
            states.append(dict(base[g]))
        else:
            states.append(dict((base or {}).get("state", {}).get(g, {})))
    keys = [k for k, v in states[0].items() if torch.is_tensor(v) and v.dim() > 0]
    return ({k: [s[k] for s in states] for k in keys},
            {k: v for k, v in states[0].items() if k not in keys})


def _param_groups(opt: Mapping) -> list[dict]:
    base = opt.get("base_optimizer_state", opt.get("optimizer_state_dict"))
    if isinstance(base, Mapping):
        return [dict(g) for g in base.get("param_groups", [])]
    return []


def _stage12(optims: Sequence[Mapping], shapes: Sequence[Mapping[str, Sequence[int]]],
             found: ds_files.Files, need: Needed | None) -> ByName:
    out = ByName({})
    for g, group in enumerate(shapes):
        flats = [o["single_partition_of_fp32_groups"][g] for o in optims]
        tensors, scalars = _group_states(optims, g)
        total = sum(math.prod(s) for s in group.values())
        if total > sum(f.numel() for f in flats):
            raise UsageError(f"param group {g} records {total} elements but the optimizer "
                             f"files hold {sum(f.numel() for f in flats)}",
                             where=str(found.optim[0]),
                             hint="the files are of different saves: keep one save's files")
        off = 0
        for name, shape in group.items():
            n = math.prod(shape)
            if need is None or name in need.values:
                out.values[name] = _span(flats, off, n).view(tuple(shape))
            if tensors and (need is None or name in need.state):
                out.state[name] = {k: _span(ranks, off, n).view(tuple(shape))
                                   for k, ranks in tensors.items()}
                out.scalars[name] = dict(scalars)
            off += n
        out.present.update(group)
    return out


def _span(flats: Sequence[torch.Tensor], off: int, n: int) -> torch.Tensor:
    """Elements ``[off, off + n)`` of the ranks' partitions laid end to end: a view of one
    partition (memory-mapped, read when used) when they lie in one."""
    pieces, base = [], 0
    for flat in flats:
        lo, hi = max(off, base), min(off + n, base + flat.numel())
        if lo < hi:
            pieces.append(flat[lo - base:hi - base])
        base += flat.numel()
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _stage3(optims: Sequence[Mapping], shapes: Sequence[Mapping[str, Sequence[int]]],
            world: int, found: ds_files.Files, need: Needed | None) -> ByName:
    out = ByName({})
    for g, group in enumerate(shapes):
        flats = [o["fp32_flat_groups"][g] for o in optims]
        tensors, scalars = _group_states(optims, g)
        per_rank = sum(math.ceil(math.prod(s) / world) for s in group.values())
        if any(f.numel() < per_rank for f in flats):
            raise UsageError(f"param group {g} needs {per_rank} elements per rank, a rank file "
                             "holds fewer", where=str(found.optim[0]),
                             hint="the files are of different saves: keep one save's files")
        off = 0
        for name, shape in group.items():
            n = math.prod(shape)
            part = math.ceil(n / world)
            if need is None or name in need.values:
                out.values[name] = _joined([f[off:off + part] for f in flats], n, shape)
            if tensors and (need is None or name in need.state):
                out.state[name] = {k: _joined([r[off:off + part] for r in ranks], n, shape)
                                   for k, ranks in tensors.items()}
                out.scalars[name] = dict(scalars)
            off += part
        out.present.update(group)
    frozen = [ds_files.load(p).get("frozen_param_fragments") or {} for p in found.model]
    for name, shape in (ds_files.load(found.model[0]).get("frozen_param_shapes") or {}).items():
        if all(name in f for f in frozen):
            out.values[name] = _joined([f[name] for f in frozen], math.prod(shape), shape)
    return out


def _joined(pieces: Sequence[torch.Tensor], numel: int, shape: Sequence[int]) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in pieces])[:numel].view(tuple(shape))


def scaler_state(scaler: Any, holder: Mapping) -> dict | None:
    """DeepSpeed's loss scaler state (its object's attributes, or stage 0's keys) in
    deepshard's loss scaler ``state_dict`` form."""
    source = vars(scaler) if scaler is not None and not isinstance(scaler, Mapping) \
        else holder
    keys = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
    state = {k: source[k] for k in keys if k in source}
    return state if "cur_scale" in state else None
