"""The engine's checkpoints: ``save_checkpoint``, ``load_checkpoint``, ``save_16bit_model``.

Everything here goes through the engine's public state — ``module``, ``optimizer``,
``lr_scheduler``, ``loss_scaler``, ``counters``, ``strategy`` (what the data-parallel
strategy writes and restores of its own), ``topology`` (the model-parallel layout or
``None``), ``global_rank``, ``world_size``, ``dp_world_size`` and the collectives
``barrier()`` and ``agree(failure)`` — so a new strategy or layout needs nothing here.

Every load goes through the by-name form (:mod:`.by_name`), whatever stage, world size
or precision wrote the checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import cast

import torch

from deepshard.contract import DEEPSHARD_VERSION as __version__
from deepshard.errors import UsageAssertionError, UsageError, UsageValueError
from deepshard.liveness import checkpoint_saved, heartbeat
from deepshard.runtime import data_position
from deepshard.runtime.checkpoint import (
    ds_files,
    from_deepspeed,
    mapped,
    to_deepspeed,
    universal,
)
from deepshard.runtime.checkpoint import format as fmt
from deepshard.runtime.checkpoint import model_parallel as mp
from deepshard.runtime.checkpoint.by_name import ByName, Needed, aliases, read_by_name

logger = logging.getLogger("deepshard")


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest=True,
                    exclude_frozen_parameters=False) -> bool:
    """``engine.save_checkpoint`` (see there)."""
    if not isinstance(save_dir, (str, os.PathLike)) or not os.fspath(save_dir):
        raise UsageValueError(f"save_dir must be a non-empty string, got {save_dir!r}",
                              where="engine.save_checkpoint",
                              hint="pass the directory to save the checkpoint in")
    exclude = bool(exclude_frozen_parameters)
    tag = fmt.check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    tag = _same_place_everywhere(engine, save_dir, tag)
    topology = engine.topology
    if topology is None and engine.mp_group is not None:
        raise UsageError("checkpoints of a model split by a user's mpu are not supported",
                         where="engine.save_checkpoint",
                         hint="let deepshard split the model (pipeline / tensor_parallel "
                              "config sections), or save the module yourself")
    heartbeat(engine.global_steps)
    if engine._config.checkpoint.format == "deepspeed":
        to_deepspeed.save(engine, save_dir, tag, client_state, save_latest, exclude)
    else:
        _save_own(engine, save_dir, tag, client_state, save_latest, exclude)
    if engine.global_rank == 0:
        _write_converter(save_dir)
    heartbeat(engine.global_steps)
    checkpoint_saved(engine.global_steps)  # complete on every rank: ds-run may grow now
    return True


def _save_own(engine, save_dir, tag: str, client_state, save_latest: bool,
              exclude: bool) -> None:
    """deepshard's own format (:mod:`.format`): a manifest, a shared file, a rank file
    per rank."""
    topology = engine.topology
    strategy = engine.strategy
    with strategy.materialized(engine.optimizer):
        own: dict[str, object] = {"rng": fmt.rng_states()}
        payload = strategy.rank_payload(engine.optimizer, exclude)
        if payload is not None:
            own["zero"] = payload
        extra = strategy.own_state(engine.optimizer)
        if extra is not None:
            own["strategy"] = extra
        rank0 = engine.global_rank == 0
        model = _model_state(engine, exclude) if rank0 or topology is not None else None
        if topology is not None:  # every rank holds another part of the model
            own["mp"] = {**cast(dict, model), "tp_layout": _tp_layout(engine)}
        shared = _shared(engine, cast(dict, model), client_state) if rank0 else None
        fmt.save(save_dir, _manifest(engine, tag, exclude), rank=engine.global_rank,
                 shared=shared, own=own, agree=engine.agree, save_latest=save_latest)


def _same_place_everywhere(engine, save_dir, tag: str) -> str:
    """Every rank names the same ``save_dir`` (a directory named from each rank's clock,
    as DeepSpeedExamples' HelloDeepSpeed does, differs between ranks now and then:
    DeepSpeed then writes a checkpoint split over two directories) and the tag to save
    under: rank 0's.

    Ranks naming different tags: ``checkpoint.tag_validation`` ``Fail`` refuses on every
    rank before anything is written, as DeepSpeed does; ``Warn`` (the default) and
    ``Ignore`` save under rank 0's tag, warning with ``Warn``. DeepSpeed 0.19.8 saves each
    rank's files under its own tag there: a checkpoint no load can read."""
    if engine.world_size == 1:
        return tag
    everyone: list[tuple[str, str] | None] = [None] * engine.world_size
    torch.distributed.all_gather_object(everyone, (str(save_dir), tag))
    dirs = [cast(tuple, e)[0] for e in everyone]
    tags = [cast(tuple, e)[1] for e in everyone]
    other = next((r for r, d in enumerate(dirs) if d != dirs[0]), None)
    if other is not None:
        raise UsageError(f"rank 0 saves into {dirs[0]} but rank {other} into "
                         f"{dirs[other]}", where="engine.save_checkpoint",
                         hint="pass every rank the same save_dir (make a name from the "
                              "clock on rank 0 and broadcast it)")
    other = next((r for r, t in enumerate(tags) if t != tags[0]), None)
    if other is None:
        return tag
    mode = engine._config.checkpoint.tag_validation.lower()
    said = (f"rank 0 saves under tag {tags[0]!r} but rank {other} under {tags[other]!r}: "
            "a tag with rank-specific parts cannot be restored")
    if mode == "fail":
        raise UsageAssertionError(said, where="checkpoint.tag_validation",
                                  hint="pass every rank the same tag (or none: "
                                       "global_step<N>)")
    if mode == "warn" and engine.global_rank == 0:
        logger.warning("%s; every rank saves under rank 0's tag %r "
                       "(checkpoint.tag_validation Warn)", said, tags[0])
    return tags[0]


def _write_converter(save_dir) -> None:
    """DeepSpeed writes ``zero_to_fp32.py`` next to its checkpoints; so does deepshard (a
    launcher of :mod:`deepshard.runtime.checkpoint.zero_to_fp32`). The checkpoint is
    complete without it, so a failure to write it is a warning."""
    from deepshard.runtime.checkpoint.zero_to_fp32 import write_script

    try:
        write_script(save_dir)
    except OSError as exc:
        logger.warning("could not write zero_to_fp32.py into %s: %s", save_dir, exc)


def _model_state(engine, exclude_frozen: bool) -> dict:
    """The model's part of a checkpoint (without what the strategy's rank files hold)."""
    strategy, module, optimizer = engine.strategy, engine.module, engine.optimizer
    state = module.state_dict()
    owned = strategy.owned_names(module)
    skip = owned | (frozen_names(module) if exclude_frozen else set())
    return {
        "module": {k: v for k, v in state.items() if k not in skip},
        "state_names": list(state),
        "frozen_names": sorted(frozen_names(module)),
        "fp32_masters": strategy.masters_by_name(module),
        "optimizer": strategy.optimizer_state(optimizer),
        "optimizer_names": strategy.optimizer_names(optimizer),
        "aliases": aliases(module),
    }


def _shared(engine, model: dict, client_state) -> dict:
    """Rank 0's shared file: ``model`` (:func:`_model_state`; only its hyperparameters and
    names when every rank writes its own part), the schedule's state, the counters and
    the client's state."""
    if engine.topology is not None:
        optimizer = model["optimizer"]
        model = {**model, "module": {}, "fp32_masters": None, "optimizer_names": None,
                 "optimizer": None if optimizer is None else
                 {"state": {}, "param_groups": optimizer["param_groups"]}}
    return {
        **model,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler else None,
        "counters": dataclasses.asdict(engine.counters),
        "data_position": data_position.position(engine),
        "features": {f.name: f.state_dict() for f in engine.features},
        "client_state": dict(client_state or {}),
    }


def _tp_layout(engine) -> dict:
    from deepshard.runtime.parallel.tensor import tp_layout

    return {n: (s.dim, s.sections) for n, s in tp_layout(engine.module).items()}


def _manifest(engine, tag: str, exclude_frozen: bool) -> fmt.Manifest:
    strategy, topology = engine.strategy, engine.topology
    world = engine.dp_world_size if topology is None else engine.world_size
    return fmt.Manifest(
        tag=tag, world_size=world, zero_stage=strategy.stage,
        param_dtype=str(strategy.params[0].dtype if strategy.params else torch.float32),
        master_dtype=strategy.master_dtype, global_steps=engine.global_steps,
        deepshard_version=__version__,
        files=(fmt.SHARED_FILE, *(fmt.rank_file(r) for r in range(world))),
        created_unix=fmt.now(), layout=None if topology is None else mp.layout_of(topology),
        frozen_excluded=exclude_frozen)


def frozen_names(module: torch.nn.Module) -> set[str]:
    """State-dict names (aliases included) of the parameters that do not require grad."""
    return {n for n, p in module.named_parameters(remove_duplicate=False)
            if not p.requires_grad}


# -- loading ---------------------------------------------------------------------------
def load_checkpoint(engine, load_dir, tag=None, load_module_strict=True,
                    load_optimizer_states=True, load_lr_scheduler_states=True,
                    load_module_only=False):
    """``engine.load_checkpoint`` (see there)."""
    named = None if tag is None else str(tag)
    ds_tag = universal.find_tag(load_dir, named) \
        if engine._config.checkpoint.load_universal else None
    ds_tag = ds_tag or ds_files.find_tag(load_dir, named)
    manifest = None
    if ds_tag is None:
        manifest = fmt.resolve_tag(load_dir, None if tag is None else fmt.check_tag(tag))
        if manifest is None:  # nothing else here: a universal folder loads by its files
            ds_tag = universal.find_tag(load_dir, named)
    if ds_tag is not None:
        return _load_deepspeed(engine, ds_tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only)
    if manifest is None:
        if engine.global_rank == 0:
            logger.warning("no complete checkpoint in %s: starting from scratch", load_dir)
        return None, None
    path = Path(load_dir) / manifest.tag
    shared = fmt.load_file(path, fmt.SHARED_FILE)
    load_optimizer = load_optimizer_states and not load_module_only
    own = _own_file(engine, path)
    entries = _own_shards(engine, own, manifest)
    with engine.strategy.materialized(engine.optimizer):
        if entries is not None:
            _restore_shards(engine, entries, shared, load_module_strict, load_optimizer,
                            manifest, path)
        else:
            _restore_model(engine, _read(engine, path, manifest, shared), shared,
                           load_module_strict, load_optimizer, manifest, path)
        if load_optimizer:
            _restore_own(engine, own, manifest)
    if not load_module_only:
        _restore_schedule(engine, shared, load_lr_scheduler_states, own.get("rng"))
        data_position.restore(engine, shared.get("data_position"))
        restore_features(engine, shared.get("features") or {})
    engine.strategy.zero_grad()
    engine.barrier()
    return str(path), shared["client_state"]


def restore_features(engine, states: dict) -> None:
    """Hand each attached feature its state from a checkpoint (a feature the checkpoint
    has no state for starts afresh)."""
    for feature in engine.features:
        if feature.name in states:
            feature.load_state_dict(states[feature.name])


def _load_deepspeed(engine, path: Path, strict: bool, load_optimizer_states: bool,
                    load_lr_scheduler_states: bool, load_module_only: bool):
    """A DeepSpeed checkpoint (:mod:`.from_deepspeed`) or a universal one
    (:mod:`.universal`) loaded as deepshard's own are; the client state returned is what
    DeepSpeed's load returns."""
    universal_tag = universal.is_universal_tag(path)
    if universal_tag:
        loaded = universal.read(path, _needed(engine))
    else:
        loaded = from_deepspeed.read(path, engine.strategy.optimizer_groups,
                                     frozenset(frozen_names(engine.module)), _needed(engine))
    if engine.topology is not None:
        _this_stage(engine, loaded.by_name)
        _this_slice(engine, loaded.by_name, path)
    load_optimizer = load_optimizer_states and not load_module_only
    if load_optimizer:
        from_deepspeed.check_optimizer(loaded.top, path)
        from_deepspeed.check_optimizer_read(loaded)
    with engine.strategy.materialized(engine.optimizer):
        _restore_model(engine, loaded.by_name, loaded.shared, load_module_strict=strict,
                       load_optimizer=load_optimizer, manifest=loaded.manifest, path=path)
    if not load_module_only:
        _restore_schedule(engine, loaded.shared, load_lr_scheduler_states, None)
        restore_features(engine, loaded.shared.get("features") or {})
    engine.strategy.zero_grad()
    engine.barrier()
    return str(path), from_deepspeed.client_state(loaded.top, load_optimizer,
                                                  load_lr_scheduler_states)


def _this_slice(engine, by_name: ByName, path: Path) -> None:
    """Tensor parallelism: every tensor-parallel parameter's value and optimizer state cut
    to this rank's slice (as AutoTP cut the parameter itself; element-wise optimizer state
    is cut the same way)."""
    from deepshard.runtime.parallel.tensor import tp_layout
    from deepshard.runtime.parallel.tp_shards import shard_tensor

    topology = engine.topology
    if topology.tensor == 1:
        return
    rank = topology.coord(engine.global_rank).tensor
    for name, spec in tp_layout(engine.module).items():
        if name in by_name.values:
            by_name.values[name] = shard_tensor(by_name.values[name], spec, rank,
                                                topology.tensor, f"{path}: {name}")
        state = by_name.state.get(name, {})
        for key, value in state.items():
            state[key] = shard_tensor(value, spec, rank, topology.tensor,
                                      f"{path}: {name} {key}")


def _this_stage(engine, by_name: ByName) -> None:
    """Keep of ``by_name`` what this pipeline stage's module holds, dropping what another
    stage holds (names no stage holds stay: unexpected). Collective."""
    mine = set(engine.module.state_dict())
    everyone: list[set[str] | None] = [None] * engine.world_size
    torch.distributed.all_gather_object(everyone, mine)
    elsewhere = set().union(*(cast(set, e) for e in everyone)) - mine
    for table in (by_name.values, by_name.state, by_name.scalars):
        for name in elsewhere & set(table):
            del table[name]
    by_name.present -= elsewhere


def _same_world_and_stage(engine, manifest: fmt.Manifest) -> bool:
    """A data-parallel ZeRO checkpoint saved at this world size and stage."""
    return bool(manifest.zero_stage) and manifest.zero_stage == engine.strategy.stage and \
        not manifest.layout and engine.topology is None and \
        manifest.world_size == engine.dp_world_size


def _own_file(engine, path: Path) -> dict:
    """This rank's own file ({} when the checkpoint has none for it), read once and
    memory-mapped: its shards are copied into the engine's own tensors
    (:func:`_restore_shards`, which hands the pages back as it goes), or only its small
    parts are used."""
    own_file = path / fmt.rank_file(engine.global_rank)
    if not own_file.exists():
        return {}
    return fmt.load_file(path, own_file.name, mmap=True)


def _own_shards(engine, own: dict, manifest: fmt.Manifest) -> list[dict] | None:
    """This rank's saved shards when every rank's are its flat groups as they are now (a
    ZeRO checkpoint of the same world size, stage and groups): then they are copied as
    they are, not assembled by name. Collective (the ranks agree)."""
    entries = own.get("zero") if _same_world_and_stage(engine, manifest) else None
    same = entries is not None and engine.strategy.same_layout(entries)
    return entries if engine.agree(None if same else "another layout") is None else None


def _restore_shards(engine, entries: list[dict], shared: dict, load_module_strict: bool,
                    load_optimizer: bool, manifest: fmt.Manifest, path: Path) -> None:
    """:func:`_restore_model` for a checkpoint of this very layout (:func:`_own_shards`)."""
    module, strategy = engine.module, engine.strategy
    want = set(module.state_dict())
    owned = strategy.owned_names(module)
    values = shared["module"]
    module.load_state_dict({k: values[k] for k in want - owned if k in values}, strict=False)
    saved_groups = (shared.get("optimizer") or {}).get("param_groups") or []
    strategy.restore_same_layout(
        engine.optimizer, entries, load_optimizer, saved_groups,
        lambda rank: fmt.load_file(path, fmt.rank_file(rank), mmap=True)["zero"],
        mapped.Release([entries]))
    present = set(values)
    check_missing(module, (want - owned) - present, present - want - strategy.entry_names(),
                  load_module_strict, manifest, path)


def _needed(engine) -> Needed | None:
    """The names this rank takes from a checkpoint (``None``: all): its strategy's and
    what the module itself loads (stage 3's frozen shards too)."""
    need = engine.strategy.needed()
    if need is None:
        return None
    module = engine.module
    own = set(module.state_dict()) - engine.strategy.owned_names(module)
    return Needed(need.values | own, need.state)


def _read(engine, path: Path, manifest: fmt.Manifest, shared: dict) -> ByName:
    """This rank's part of the checkpoint by name (all of it where the rank keeps all)."""
    topology = engine.topology
    need = _needed(engine)
    if topology is not None or manifest.layout:
        mp.check_same_layout(manifest, topology, path)
        coord = topology.coord(engine.global_rank)
        return mp.by_name(path, manifest, coord.pipe, coord.tensor, need)[0]
    return read_by_name(path, manifest, shared, need=need)


def _restore_model(engine, by_name: ByName, shared: dict, load_module_strict: bool,
                   load_optimizer: bool, manifest: fmt.Manifest, path: Path) -> None:
    module, strategy = engine.module, engine.strategy
    want = set(module.state_dict())
    owned = strategy.owned_names(module)
    module.load_state_dict({k: by_name.values[k] for k in want - owned
                            if k in by_name.values}, strict=False)
    saved_groups = (shared.get("optimizer") or {}).get("param_groups") or []
    missing = ((want - owned) - by_name.present) | strategy.restore(
        engine.optimizer, by_name, load_optimizer, saved_groups)
    unexpected = by_name.present - want - strategy.entry_names()
    check_missing(module, missing, unexpected, load_module_strict, manifest, path)


def _restore_own(engine, own: dict, manifest: fmt.Manifest) -> None:
    """What the strategy kept in this rank's own file (the 1-bit optimizers' errors), for
    the data-parallel world size the checkpoint was saved with."""
    saved = manifest.layout["data"] if manifest.layout else manifest.world_size
    engine.strategy.restore_own(engine.optimizer, own.get("strategy"), saved)


def _restore_schedule(engine, shared: dict, load_lr_scheduler: bool, rng: dict | None) -> None:
    if load_lr_scheduler and engine.lr_scheduler and shared["lr_scheduler"]:
        engine.lr_scheduler.load_state_dict(shared["lr_scheduler"])
    saved_scale = shared["loss_scaler"]
    if engine.loss_scaler and saved_scale and \
            set(engine.loss_scaler.state_dict()) <= set(saved_scale):
        engine.loss_scaler.load_state_dict(saved_scale)
    counters = dict(shared["counters"])
    # a resumed job opens a fresh accumulation window, also at another world size or
    # gradient_accumulation_steps (no partial gradient is saved; DeepSpeed restarts its
    # micro-step count): the count rounded down to a boundary of this job's windows
    gas = engine.gradient_accumulation_steps()
    counters["micro_steps"] = counters.get("micro_steps", 0) // gas * gas
    engine.counters = dataclasses.replace(engine.counters, **counters)
    if rng is not None:  # this rank's own file had them
        fmt.set_rng_states(rng)


def check_missing(module: torch.nn.Module, missing: set[str], unexpected: set[str],
                  strict: bool, manifest: fmt.Manifest, path: Path) -> None:
    """With ``strict``, a checkpoint lacking entries of the model (or holding entries
    the model lacks) is a usage error."""
    if not strict or not (missing or unexpected):
        return
    if missing and manifest.frozen_excluded and missing <= frozen_names(module):
        raise UsageError(f"the checkpoint lacks this model's {len(missing)} frozen "
                         f"parameters: it was saved with exclude_frozen_parameters=True",
                         where=str(path),
                         hint="pass load_module_strict=False: the frozen parameters "
                              "then keep the values the model has")
    what = f"lacks {len(missing)} entries of this model: " \
        f"{', '.join(sorted(missing)[:5])}" if missing else \
        f"holds {len(unexpected)} entries this model lacks: " \
        f"{', '.join(sorted(unexpected)[:5])}"
    raise UsageError(f"the checkpoint {what}", where=str(path),
                     hint="load a checkpoint of the same model, or pass "
                          "load_module_strict=False")


# -- one whole file --------------------------------------------------------------------
def save_16bit_model(engine, save_dir, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """``engine.save_16bit_model`` (see there)."""
    if engine.topology is not None or engine.mp_group is not None:
        raise UsageError("save_16bit_model cannot gather a model split over pipeline or "
                         "tensor-parallel ranks", where="engine.save_16bit_model",
                         hint="save a checkpoint and consolidate it with "
                              "deepshard.get_fp32_state_dict()")
    strategy = engine.strategy
    if strategy.partitions_params and not \
            engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        if engine.global_rank == 0:
            logger.warning("save_16bit_model: nothing saved; set zero_optimization."
                           "stage3_gather_16bit_weights_on_model_save to gather the "
                           "stage 3 parameters for it")
        return False
    state = _gathered_state(engine, exclude_frozen_parameters)
    if state is not None:
        path = Path(save_dir) / save_filename
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial")
        torch.save(state, tmp)
        os.replace(tmp, path)
    engine.barrier()
    return True


def _gathered_state(engine, exclude_frozen: bool) -> dict | None:
    """Rank 0's copy of the whole module state (None elsewhere), gathering partitioned
    parameters one flat group at a time: no rank ever holds the whole model but rank 0's
    CPU copy."""
    from deepshard.runtime.zero.init import GatheredParameters

    module, rank0 = engine.module, engine.global_rank == 0
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    gathered: dict[str, torch.Tensor] = {}
    for params in engine.strategy.gather_groups():
        with GatheredParameters(params):
            if rank0:
                for p in params:
                    value = p.detach().cpu().clone()
                    gathered.update((n, value) for n in names[id(p)])
    if not rank0:
        return None
    skip = frozen_names(module) if exclude_frozen else set()
    return {k: gathered[k] if k in gathered else v.detach().cpu().clone()
            for k, v in module.state_dict().items() if k not in skip}
