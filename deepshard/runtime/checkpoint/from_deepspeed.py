"""A DeepSpeed checkpoint (any ZeRO stage, fp32 / fp16 / bf16) read into deepshard's
by-name form, so ``load_checkpoint`` and the consolidation read it as they read deepshard's
own, at any world size and stage.

DeepSpeed keeps fp32 masters and optimizer state as flat partitions at ZeRO 1-3
(:mod:`.ds_partitions`). Stage 0 keeps whole tensors by optimizer position; its positions
are named by the loading job's optimizer groups (DeepSpeed's own load matches them by
position too), an MoE model's by its groups (dense, then each expert-parallel rank's
experts). Pipelines and MoE models add per-layer and per-expert files (:mod:`.ds_parallel`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import (
    ds_files,
    ds_parallel,
    ds_partitions,
    ds_positions,
    mapped,
)
from deepshard.runtime.checkpoint import format as fmt
from deepshard.runtime.checkpoint.by_name import ByName, Needed, in_order

DEEPSPEED_STATES = ("module", "skipped_steps", "global_steps", "dp_world_size",
                    "mp_world_size", "data_sampler", "random_ltd")
"""Keys DeepSpeed's ``load_checkpoint`` keeps out of the ``client_state`` it returns (with
``lr_scheduler`` / ``optimizer`` when it loads them)."""


@dataclass
class Loaded:
    """A DeepSpeed checkpoint as deepshard's load takes it: a manifest and a shared dict
    of deepshard's shape, the values and optimizer state by name, the model file's top
    level (for the ``client_state`` DeepSpeed would return), and the file of any optimizer
    state left unread (a pipeline's or MoE model's without ZeRO: by position, per stage or
    expert-parallel rank)."""

    manifest: fmt.Manifest
    shared: dict
    by_name: ByName
    top: dict
    unread_optimizer: Path | None = None  # optimizer state there that was not read


def read(tag_dir: Path, position_names: Sequence[Sequence[str]] | None = None,
         frozen: frozenset[str] = frozenset(), need: Needed | None = None) -> Loaded:
    """The DeepSpeed checkpoint in ``tag_dir`` (data parallel, pipeline, MoE). ``position_names``:
    the names of the loading job's optimizer groups, in order, frozen ones (``frozen``)
    included, which name a stage 0 checkpoint's optimizer positions (default: the
    checkpoint's parameters in module order, matched by shape). ``need``: assemble only
    these names' values and state from the ZeRO partitions (default: all).

    Raises:
        UsageError: a missing or extra rank, layer or expert file, files of another world
            size, or state that does not fit the shapes recorded (one line naming the file).
    """
    found = ds_files.files(tag_dir)
    if found.stages:
        return _pipeline(found, need)
    top = _top(found)
    world = int(top.get("dp_world_size") or 1)
    stage = _stage(found)
    _check_counts(found, stage, world)
    module = _module(found, top)
    if found.experts:
        module.update(ds_parallel.expert_values(found, top))
    unread: Path | None = None
    groups: list[dict] = []
    scaler: dict | None = None
    if stage == 0 and found.experts:
        out, groups, unread = ds_positions.moe_stage0(top, module, found)
    elif stage == 0:
        out, groups, scaler = ds_positions.stage0(top, module, position_names, frozen, tag_dir)
    else:
        optims = [ds_files.load(p)["optimizer_state_dict"] for p in found.optim]
        groups = ds_partitions.param_groups(optims[0])
        shapes = top["param_shapes"] or []
        if stage == 3:
            out = ds_partitions.stage3(optims, shapes, world, found, need)
        else:
            out = ds_partitions.stage12(optims, shapes, found, need, groups)
        for name, value in module.items():
            out.values.setdefault(name, value)
        out.release = mapped.Release(optims)
        scaler = ds_partitions.scaler_state(optims[0].get("loss_scaler"), optims[0])
    for alias, canonical in (top.get("shared_params") or {}).items():
        if canonical in out.values:
            out.values[alias] = out.values[canonical]
    out.present.update(out.values)
    return loaded(tag_dir, top, out, stage, groups, scaler, found, unread)


def _check_counts(found: ds_files.Files, stage: int, world: int) -> None:
    where = str(found.tag_dir)
    if stage and len(found.optim) != world:
        raise UsageError(f"{len(found.optim)} optimizer partition files for a world of "
                         f"{world} ranks", where=where,
                         hint="copy the whole tag directory (one optimizer file per rank); "
                              "files of two saves must not be mixed")
    if stage == 3 and len(found.model) != world:
        raise UsageError(f"{len(found.model)} stage 3 model files for a world of {world} "
                         "ranks", where=where,
                         hint="copy the whole tag directory (one model file per rank)")
    if stage == 3 and (found.experts or found.stages):
        raise UsageError(f"DeepSpeed {'MoE' if found.experts else 'pipeline'} checkpoints "
                         "of ZeRO stage 3 are not read", where=where,
                         hint="resume it in DeepSpeed, or start from its consolidated "
                              "weights (DeepSpeed's zero_to_fp32)")


def _pipeline(found: ds_files.Files, need: Needed | None) -> Loaded:
    """A pipeline checkpoint: the layer files' values, every stage's partitions' fp32
    masters and optimizer state, by global name."""
    tops = [ds_files.load(s.model[0]) for s in found.stages]
    stages = int(tops[0].get("mp_world_size") or 1)
    if stages > len(tops):
        raise UsageError(f"{ds_files.model_file(len(tops))} is missing (a pipeline of "
                         f"{stages} stages)", where=str(found.tag_dir),
                         hint="copy the whole tag directory (every stage's files)")
    world = int(tops[0].get("dp_world_size") or 1)
    stage = _stage(found)
    module = ds_parallel.layer_values(found)
    out, unread, scaler = ByName(dict(module)), None, None
    groups: list[dict] = []
    buffers = {n for top in tops for n in top.get("buffer_names") or ()}
    candidates, start = [n for n in module if n not in buffers], 0
    for files, top in zip(found.stages, tops, strict=True):
        shapes = top.get("param_shapes") or []
        ds_parallel.check_layers(found, (n for g in shapes for n in g))
        _check_counts(files, stage, world)
        if stage == 0:
            start, own, unread_here = ds_positions.pipe_stage0(out, top, files, module,
                                                               candidates, start)
            groups, unread = groups or own, unread or unread_here
            continue
        optims = [ds_files.load(p)["optimizer_state_dict"] for p in files.optim]
        own_groups = ds_partitions.param_groups(optims[0])
        groups = groups or own_groups
        scaler = scaler or ds_partitions.scaler_state(optims[0].get("loss_scaler"), optims[0])
        part = ds_partitions.stage12(optims, shapes, files, need, own_groups)
        out.values.update(part.values)
        out.state.update(part.state)
        out.scalars.update(part.scalars)
        out.present.update(part.present)
    out.present.update(out.values)
    top = ds_parallel.merged_top(tops, module)
    return loaded(found.tag_dir, top, out, stage, groups, scaler, found, unread)


def loaded(tag_dir: Path, top: Mapping[str, Any], out: ByName, stage: int,
           groups: list[dict], scaler: dict | None, found: ds_files.Files,
           unread: Path | None = None) -> Loaded:
    """:class:`Loaded` from what was read: the model file's top level ``top``, the
    values and state by name, the stage, the optimizer's param groups and loss scale;
    ``unread``: the file of optimizer state that could not be read by name."""
    world = int(top.get("dp_world_size") or 1)
    module = top.get("module") or {}
    manifest = fmt.Manifest(
        tag=tag_dir.name, world_size=world, zero_stage=stage,
        param_dtype=str(_param_dtype(module)), master_dtype="torch.float32",
        global_steps=int(top.get("global_steps", 0)), deepshard_version="deepspeed " +
        str(top.get("ds_version", "?")), files=_names(found),
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
        # DeepSpeed's data-efficiency states, for deepshard.data_efficiency's feature
        "features": {"data_efficiency": {key: top[key] for key in ("random_ltd", "data_sampler")
                                         if top.get(key) is not None}},
    }
    return Loaded(manifest, shared, out, dict(top), unread)


def _names(found: ds_files.Files) -> tuple[str, ...]:
    stages = found.stages or (found,)
    return tuple(p.name for s in stages for p in (*s.model, *s.optim)) + \
        tuple(p.name for _, p in found.layers) + tuple(p.name for _, _, p in found.experts) + \
        tuple(p.name for p in found.expert_optim)


def consolidated(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The whole model state of a DeepSpeed checkpoint (fp32 masters where kept), in the
    order of its module's state dict (DeepSpeed's ``zero_to_fp32`` order; a pipeline's
    layers by index; an MoE layer's experts, every one, by global id after its gate)."""
    loaded = read(tag_dir)
    values = loaded.by_name.values
    order = ds_parallel.with_experts(list(loaded.top.get("module") or {}),
                                     [n for n in values if ds_parallel.EXPERT.fullmatch(n)])
    return in_order(values, order)


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


def check_optimizer_read(loaded: Loaded) -> None:
    """Refuse, in one line, to load optimizer state the read could not name (a pipeline's
    or an MoE model's without ZeRO keeps it by position per stage or expert-parallel rank).

    Raises:
        UsageError: naming the file, with ``load_optimizer_states=False`` as the way on.
    """
    if loaded.unread_optimizer is not None:
        raise UsageError("the optimizer state of a DeepSpeed pipeline or MoE checkpoint "
                         "saved without ZeRO is kept by position and is not read",
                         where=str(loaded.unread_optimizer),
                         hint="load it with load_optimizer_states=False: the weights, "
                              "schedule and counters still load (the optimizer starts "
                              "afresh); or save it from DeepSpeed at ZeRO stage 1-2")


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
