"""Save a deepshard-trained HF model in the HF format, from any ZeRO stage.

``save_pretrained(engine, dir)`` writes what ``from_pretrained`` loads, as transformers
5.23's ``PreTrainedModel.save_pretrained`` names and splits it: ``model.safetensors``, or
``model-0000K-of-0000N.safetensors`` with ``model.safetensors.index.json``, plus
``config.json`` and ``generation_config.json``; a PEFT model gets what peft's
``save_pretrained`` writes (``adapter_model.safetensors``, ``adapter_config.json``).

How, in three steps:

- plan (pure): the state dict's names without tied duplicates (transformers' own rule
  decides which name stays), their full sizes (``ds_shape`` at stage 3), and the shard
  files they go to (:func:`plan_shards`, huggingface_hub's greedy split);
- write: shard ``k`` belongs to rank ``k % world``; in rounds of ``world`` shards, every
  rank joins the gather of each of the round's shards (``GatheredParameters`` is a
  collective) and keeps a CPU copy of its own shard's tensors only, then writes it: a
  rank holds at most one shard in CPU memory and one shard gathered on its device;
- commit: everything is written under ``<dir>/.deepshard-save.partial`` first; the main
  rank then removes the old marker files (index, single weights file), moves the shards,
  the configs and, last, the new marker in. A crash at any point leaves no directory
  that looks complete but holds a half model.

``consolidated_16bit_state_dict(engine)`` is DeepSpeed's
``engine._zero3_consolidated_16bit_state_dict()``: the whole state dict on rank 0.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepshard.errors import UsageError
from deepshard.integrations.hf_shards import SAFE_WEIGHTS, ShardPlan, index_json, plan_shards

logger = logging.getLogger("deepshard")

SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
STAGING = ".deepshard-save.partial"
GATHER_CHUNK = 2**30  # bytes gathered at once by consolidated_16bit_state_dict
_SHARD_NAME = re.compile(r"(.*?)-\d{5}-of-\d{5}")
_WHERE = "save_pretrained"


def save_pretrained(engine: Any, save_directory: str | os.PathLike, *,
                    max_shard_size: int | str = "5GB",
                    exclude_frozen_parameters: bool = False,
                    safe_serialization: bool = True,
                    state_dict: dict[str, torch.Tensor] | None = None,
                    is_main_process: bool | None = None) -> None:
    """Write the engine's model to ``save_directory`` in the HF format (see the module
    docstring), from any ZeRO stage; ``from_pretrained(save_directory)`` loads it.

    Collective: every rank must call it, with the same arguments; ranks write shard files
    in parallel, so ``save_directory`` must be on a filesystem every rank sees.

    Args:
        engine: what ``deepshard.initialize`` returned (its ``module`` is a transformers
            ``PreTrainedModel`` or a peft ``PeftModel``), or such a model itself (e.g. one
            built under ``zero.Init``).
        save_directory: created when missing; files of an earlier save there are replaced
            (stale shard files removed, as transformers does).
        max_shard_size: most bytes per weights file (int, or ``"5GB"``-style). The default
            is 5GB, not transformers' 50GB: each rank holds one shard in CPU memory.
        exclude_frozen_parameters: leave out parameters with ``requires_grad=False``.
        safe_serialization: safetensors (default); ``False`` writes ``pytorch_model*.bin``
            with ``torch.save``.
        state_dict: as in transformers, save this (main rank's) dict instead of the
            model's; nothing is gathered, the main rank writes every file.
        is_main_process: whether this rank writes the configs and the index (the lowest
            rank passing True); default: rank 0.

    Values are those the model's parameters hold (bf16 when trained in bf16), like
    DeepSpeed's 16-bit save. Raises :class:`~deepshard.errors.UsageError` (on every rank)
    for a ``save_directory`` that is a file, a model of another kind, a model split over
    pipeline or tensor-parallel ranks, or a write that failed (the old save stays).
    """
    module = _module_of(engine)
    target = _target_dir(save_directory)
    rank, _ = _rank_world()
    main = _main_rank(is_main_process, rank)
    staging = target / STAGING
    if rank == main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _broadcast(None, main)  # the staging directory exists before anyone writes there
    if _is_peft(module):
        _save_peft(module, staging, target, main, rank, safe_serialization, state_dict)
    else:
        _require_transformers_model(module)
        if state_dict is None:
            state_dict = _gathered_experts(module, rank, main)
        _save_model(module, staging, target, main, max_shard_size, exclude_frozen_parameters,
                    safe_serialization, state_dict)


def _gathered_experts(module: Any, rank: int, main: int) -> dict[str, torch.Tensor] | None:
    """For a model whose HF MoE blocks are sharded over expert-parallel ranks
    (:func:`deepshard.moe.hf.shard_hf_moe`): the whole state dict under transformers'
    names on the main rank (a collective), so the files load into a plain model; else
    ``None``."""
    from deepshard.moe.hf import expert_parallel_layers, hf_state_dict

    if not expert_parallel_layers(module):
        return None
    full = hf_state_dict(module)
    return full if rank == main else None


def _save_model(module: Any, staging: Path, target: Path, main: int,
                max_shard_size: int | str, exclude_frozen: bool, safe: bool,
                state_dict: dict[str, torch.Tensor] | None) -> None:
    """A transformers model: plan, write in rounds, and let the main rank commit."""
    rank, world = _rank_world()
    given = _all_gather(state_dict is not None)
    if any(given) and not given[main]:
        raise UsageError("state_dict was passed on some ranks but not on the main one",
                         where=_WHERE, hint="pass the state dict on the main rank (rank 0)")
    weights_name = SAFE_WEIGHTS if safe else BIN_WEIGHTS
    sources = _sources(module, state_dict if given[main] else None, exclude_frozen)
    renamed = _converted_names(module, sources)
    sources = renamed if renamed is not None else sources
    plan = plan_shards({k: _nbytes(t) for k, t in sources.items()}, max_shard_size,
                       weights_name)
    collective = not given[main]  # a given state dict: the main rank writes every file
    failure, written = _write_shards(module, sources, plan, main, rank, world, staging,
                                     safe, collective, renamed is None)
    reports = _all_gather((failure, written))
    failure = next((f for f, _ in reports if f is not None), None)
    module.config.dtype = str(module.dtype).split(".")[1]  # as transformers does, every rank
    module.config.architectures = [type(module).__name__]
    if failure is None:
        weight_map = {key: name for _, files in reports for name, keys in files.items()
                      for key in keys}
        if rank == main:
            failure = _attempt(lambda: _finish_model(module, plan, weight_map, staging,
                                                     target, weights_name))
        failure = _broadcast(failure, main)
    _raise_if_failed(failure, main, staging, target)


def consolidated_16bit_state_dict(engine: Any, exclude_frozen_parameters: bool = False
                                  ) -> dict[str, torch.Tensor]:
    """DeepSpeed's ``engine._zero3_consolidated_16bit_state_dict()``: rank 0 gets the
    module's whole state dict on the CPU, in the parameters' dtype (tied names share one
    tensor), every other rank an empty dict. Any ZeRO stage; collective.

    Raises :class:`~deepshard.errors.UsageError` (on every rank) when the model would take
    more than half of rank 0's available memory: write it with the sharded
    :func:`save_pretrained` then, which never holds more than one shard per rank.
    """
    module = _module_of(engine)
    rank, _ = _rank_world()
    sources = _sources(module, None, exclude_frozen_parameters, drop_tied=False)
    unique = {id(t): t for t in sources.values()}
    total = sum(_nbytes(t) for t in unique.values())
    failure = _too_big(total) if rank == 0 else None
    failure = next((f for f in _all_gather(failure) if f is not None), None)
    if failure is not None:
        raise UsageError(failure, where="consolidated_16bit_state_dict",
                         hint="write it shard by shard with deepshard.integrations.hf_save."
                              "save_pretrained(engine, save_directory)")
    values: dict[int, torch.Tensor] = {}
    chunks = plan_shards({str(i): _nbytes(t) for i, t in unique.items()}, GATHER_CHUNK)
    for chunk in chunks.files:  # gathered a chunk at a time: never the whole model
        tensors = [unique[int(i)] for i in chunk.keys]
        values.update(_gather_values(tensors, set(unique) if rank == 0 else set(),
                                     gather=True))
    return {key: values[id(t)] for key, t in sources.items()} if rank == 0 else {}


# -- what is saved -----------------------------------------------------------------------
def _module_of(engine: Any) -> torch.nn.Module:
    if getattr(engine, "topology", None) is not None or \
            getattr(engine, "mp_group", None) is not None:
        raise UsageError("cannot save a model split over pipeline or tensor-parallel ranks "
                         "in the HF format", where=_WHERE,
                         hint="save a checkpoint (engine.save_checkpoint) and consolidate it "
                              "with deepshard.get_fp32_state_dict()")
    module = getattr(engine, "module", engine)
    if not isinstance(module, torch.nn.Module):
        raise UsageError(f"expected a deepshard engine or a model, got "
                         f"{type(engine).__name__}", where=_WHERE,
                         hint="pass what deepshard.initialize returned first")
    return module


def _is_peft(module: torch.nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a PeftModel exists only once peft is imported
    return peft is not None and isinstance(module, peft.PeftModel)


def _require_transformers_model(module: torch.nn.Module) -> None:
    from transformers import PreTrainedModel

    if not isinstance(module, PreTrainedModel):
        raise UsageError(f"the engine's module is a {type(module).__name__}, not a "
                         f"transformers PreTrainedModel or a peft PeftModel", where=_WHERE,
                         hint="save other models with engine.save_16bit_model or "
                              "consolidated_16bit_state_dict(engine)")
    if getattr(module, "_hf_peft_config_loaded", False):
        raise UsageError("the model carries adapters loaded through transformers' "
                         "load_adapter; saving only those is not supported here",
                         where=_WHERE, hint="train a peft.get_peft_model(...) model instead: "
                                            "its adapter is saved as peft saves it")


def _sources(module: torch.nn.Module, given: Mapping[str, torch.Tensor] | None,
             exclude_frozen: bool, drop_tied: bool = True) -> dict[str, torch.Tensor]:
    """Key -> the live tensor (parameter, possibly partitioned, or buffer) each saved
    entry comes from, in state-dict order, tied duplicates dropped as transformers does."""
    live = dict(given) if given is not None else module.state_dict(keep_vars=True)
    live = {k: v for k, v in live.items() if torch.is_tensor(v)}
    if exclude_frozen:
        frozen = {id(p) for p in module.parameters() if not p.requires_grad}
        live = {k: v for k, v in live.items() if id(v) not in frozen}
    for key in getattr(module, "_keys_to_ignore_on_save", None) or ():
        live.pop(key, None)
    if given is not None:  # the caller's whole tensors: transformers' own test, on storage
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        return remove_tied_weights_from_state_dict(live, module)
    return _drop_tied(live, module) if drop_tied else live


def _drop_tied(live: dict[str, torch.Tensor], module: torch.nn.Module
               ) -> dict[str, torch.Tensor]:
    """transformers' ``remove_tied_weights_from_state_dict`` decides, on one small
    stand-in per distinct tensor: partitioned parameters hold empty tensors that would all
    look alike to its storage test."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    standins: dict[int, torch.Tensor] = {}
    probe = {k: standins.setdefault(id(v), torch.empty(1)) for k, v in live.items()}
    try:
        kept = remove_tied_weights_from_state_dict(probe, module)
    except RuntimeError as exc:
        raise UsageError(f"the model shares tensors its _tied_weights_keys do not declare: "
                         f"{str(exc).splitlines()[0]}", where=_WHERE,
                         hint="declare the tie in the model class's _tied_weights_keys, "
                              "or untie the weights") from None
    return {k: live[k] for k in kept}


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
    # ds_shape may be torch.Size([]) (a scalar): falsy, so test presence, not truth
    return tuple(t.ds_shape) if hasattr(t, "ds_shape") else tuple(t.shape)


def _nbytes(t: torch.Tensor) -> int:
    numel = 1
    for d in _full_shape(t):
        numel *= d
    return numel * int(t.element_size())


def _num_parameters(module: torch.nn.Module) -> int:
    """transformers' ``num_parameters()`` with partitioned parameters counted whole."""
    total = 0
    for p in module.parameters():
        numel = 1
        for d in _full_shape(p):
            numel *= d
        total += numel
    return total


# -- gathering and writing ---------------------------------------------------------------
def _gather_values(tensors: Sequence[torch.Tensor], keep: set[int], gather: bool
                   ) -> dict[int, torch.Tensor]:
    """Gather ``tensors`` (with ``gather``, a collective: the same list on every rank) and
    return CPU copies of those whose ``id`` is in ``keep``, by ``id``."""
    from deepshard.runtime.zero.init import GatheredParameters

    out: dict[int, torch.Tensor] = {}
    with torch.no_grad(), GatheredParameters(list(tensors), enabled=gather):
        for t in tensors:
            if id(t) in keep and id(t) not in out:
                out[id(t)] = t.detach().to("cpu", copy=True).contiguous()
    return out


def _write_shards(module: torch.nn.Module, sources: Mapping[str, torch.Tensor],
                  plan: ShardPlan, main: int, rank: int, world: int,
                  staging: Path, safe: bool, collective: bool, convert: bool
                  ) -> tuple[str | None, dict[str, list[str]]]:
    """Write this rank's files of ``plan`` into ``staging``, round by round (see the module
    docstring). Returns the first failure (the rank still joins every gather after it) and
    the keys each file written holds (after any per-shard weight conversion)."""
    def owner(k: int) -> int:
        return k % world if collective else main

    failure: str | None = None
    written: dict[str, list[str]] = {}
    for rnd in plan.rounds(world if collective else 1):
        for k in rnd:
            if not collective and owner(k) != rank:
                continue
            shard = plan.files[k]
            tensors = [sources[key] for key in shard.keys]
            mine = owner(k) == rank
            values = _gather_values(tensors, {id(t) for t in tensors} if mine else set(),
                                    gather=collective)
            if not mine or failure is not None:
                continue
            state = {key: values[id(sources[key])] for key in shard.keys}
            path = staging / shard.name
            failure = _attempt(functools.partial(_write_into, written, shard.name, module,
                                                 state, path, safe, convert))
            del values, state
    return failure, written


def _converted_names(module: torch.nn.Module, sources: dict[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor] | None:
    """Saved name -> live tensor after transformers' ``revert_weight_conversion``, run on
    shape-only stand-ins, when it only renames and reorders (it sorts the keys of a model
    ``from_pretrained`` built); ``None`` when it computes new tensors: then each shard is
    converted after its gather, as transformers' offloaded path does."""
    from transformers.core_model_loading import revert_weight_conversion

    standins = {k: torch.empty(_full_shape(v), dtype=v.dtype, device="meta")
                for k, v in sources.items()}
    key_of = {id(v): k for k, v in standins.items()}
    try:
        out = revert_weight_conversion(module, dict(standins))
    except Exception:  # a converter that cannot run on meta tensors
        return None
    if any(id(v) not in key_of for v in out.values()):
        return None
    return {name: sources[key_of[id(v)]] for name, v in out.items()}


def _revert_conversion(module: torch.nn.Module, state: dict[str, torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
    """transformers' ``revert_weight_conversion`` on one shard (as its offloaded path
    does; a no-op for models without weight conversions, such as Llama or GPT-2)."""
    from transformers.core_model_loading import revert_weight_conversion

    try:
        return dict(revert_weight_conversion(module, dict(state)))
    except Exception as exc:  # a converter that needs tensors of another shard
        raise UsageError(f"could not convert the weights of one shard back to the "
                         f"checkpoint format ({type(exc).__name__}: {exc})", where=_WHERE,
                         hint="raise max_shard_size so that the tensors one conversion "
                              "needs land in one shard") from None


def _write_into(written: dict[str, list[str]], name: str, module: torch.nn.Module,
                state: dict[str, torch.Tensor], path: Path, safe: bool, convert: bool
                ) -> None:
    written[name] = _write_file(module, state, path, safe, convert)


def _write_file(module: torch.nn.Module, state: dict[str, torch.Tensor], path: Path,
                safe: bool, convert: bool) -> list[str]:
    """Write one shard file (``convert``: revert the weight conversion first); returns the
    keys it holds."""
    if convert:
        state = _revert_conversion(module, state)
    if safe:
        from safetensors.torch import save_file

        save_file(state, str(path), metadata={"format": "pt"})
    else:
        torch.save(state, path)
    return list(state)


def _finish_model(module: Any, plan: ShardPlan, weight_map: dict[str, str], staging: Path,
                  target: Path, weights_name: str) -> None:
    """Main rank: write the configs (and the index) into ``staging``, then commit."""
    missing = sorted({n for n in weight_map.values() if not (staging / n).is_file()})
    if missing:
        raise UsageError(f"{len(missing)} weights files other ranks wrote are not in "
                         f"{staging} on the main rank (e.g. {missing[0]})", where=_WHERE,
                         hint="every rank writes its shards: save into a directory on a "
                              "filesystem all nodes share")
    if module.is_remote_code():  # a trust_remote_code model: its code goes along
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(module, staging, config=module.config)
    module.config.save_pretrained(staging)
    if module.can_generate():
        module.generation_config.save_pretrained(staging)
    index_name = SAFE_INDEX if weights_name == SAFE_WEIGHTS else BIN_INDEX
    if plan.is_sharded:
        text = index_json(weight_map, plan.total_size, _num_parameters(module))
        (staging / index_name).write_text(text, encoding="utf-8")
    marker = index_name if plan.is_sharded else weights_name
    keep = {f.name for f in plan.files}
    stale = [target / n for n in (SAFE_INDEX, BIN_INDEX, SAFE_WEIGHTS, BIN_WEIGHTS)]
    stale += [p for p in target.iterdir() if p.is_file() and p.name not in keep
              and _is_shard_of(p.name, weights_name)]
    _commit(staging, target, stale, [marker])


def _is_shard_of(filename: str, weights_name: str) -> bool:
    stem = weights_name.rpartition(".")[0]
    return filename.startswith(stem) and \
        _SHARD_NAME.fullmatch(filename.rpartition(".")[0]) is not None


# -- PEFT --------------------------------------------------------------------------------
def _save_peft(model: Any, staging: Path, target: Path, main: int, rank: int, safe: bool,
               state_dict: Mapping[str, torch.Tensor] | None) -> None:
    """peft's own ``save_pretrained`` on the main rank, into ``staging``, given the
    gathered entries it picks (found by running its selection on shape-only stand-ins)."""
    def select() -> list[str]:
        return _peft_keys(model) if state_dict is None else []

    keys = _broadcast(select() if rank == main else None, main)
    live = model.state_dict(keep_vars=True)
    tensors = [live[k] for k in keys]
    values = _gather_values(tensors, {id(t) for t in tensors} if rank == main else set(),
                            gather=True)
    failure = None
    if rank == main:
        given = dict(state_dict) if state_dict is not None else \
            {k: values[id(live[k])] for k in keys}

        def write() -> None:
            model.save_pretrained(str(staging), safe_serialization=safe, state_dict=given,
                                  is_main_process=True)
            _commit(staging, target, [], ["adapter_config.json"])

        failure = _attempt(write)
    _raise_if_failed(_broadcast(failure, main), main, staging, target)


def _peft_keys(model: Any) -> list[str]:
    """The state-dict keys peft saves for every adapter: its selection run on meta
    stand-ins, mapped back by identity (all of them when a tuner computes new tensors)."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    live = model.state_dict(keep_vars=True)
    standins = {k: torch.empty(_full_shape(v), dtype=v.dtype, device="meta")
                for k, v in live.items() if torch.is_tensor(v)}
    key_of = {id(v): k for k, v in standins.items()}
    keys: dict[str, None] = {}
    for adapter in model.peft_config:
        picked = get_peft_model_state_dict(model, state_dict=standins, adapter_name=adapter)
        for value in picked.values():
            if id(value) not in key_of:
                return list(standins)
            keys[key_of[id(value)]] = None
    return list(keys)


# -- files and ranks ---------------------------------------------------------------------
def _target_dir(save_directory: str | os.PathLike) -> Path:
    target = Path(save_directory)
    if target.exists() and not target.is_dir():
        raise UsageError("is a file, not a directory", where=str(target),
                         hint="pass the directory to save the model into")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the directory ({exc.strerror})", where=str(target),
                         hint="pass a directory you can write to") from None
    return target


def _commit(staging: Path, target: Path, stale: Iterable[Path], markers: Sequence[str]
            ) -> None:
    """Move every file of ``staging`` into ``target`` (same relative path), the ones named
    in ``markers`` last; first remove ``stale`` files and the markers being replaced, so
    that no moment shows a marker beside a half-replaced set of files."""
    staged = sorted(p for p in staging.rglob("*") if p.is_file())
    last = [p for p in staged if p.name in markers]
    for path in [*(target / p.relative_to(staging) for p in last), *stale]:
        if path.is_file():
            path.unlink()
    ordered = [p for p in staged if p.name not in markers]
    ordered += sorted(last, key=lambda p: markers.index(p.name))
    for src in ordered:
        dst = target / src.relative_to(staging)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
    shutil.rmtree(staging, ignore_errors=True)


def _attempt(action: Callable[[], None]) -> str | None:
    """Run ``action``; a failure as one line (the ranks then agree on it instead of one
    rank raising while the others wait in a collective)."""
    try:
        action()
    except UsageError as exc:
        return str(exc)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _raise_if_failed(failure: str | None, main: int, staging: Path, target: Path) -> None:
    rank, _ = _rank_world()
    if failure is None:
        return
    if rank == main:
        shutil.rmtree(staging, ignore_errors=True)
    if "No such file" in failure:
        hint = "every rank writes its shards: save_directory must be on a filesystem " \
               "all nodes share"
    else:
        hint = "free space or fix permissions there and save again; the previous save " \
               "(if any) is unchanged"
    raise UsageError(f"saving failed: {failure}", where=str(target), hint=hint)


def _too_big(total: int) -> str | None:
    import psutil

    available = psutil.virtual_memory().available
    if total <= available // 2:
        return None
    return (f"the whole model ({total / 2**30:.1f} GiB) does not fit in half of the "
            f"{available / 2**30:.1f} GiB of memory available on rank 0")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _main_rank(is_main_process: bool | None, rank: int) -> int:
    if is_main_process is None:
        return 0
    flags = _all_gather(bool(is_main_process))
    if not any(flags):
        raise UsageError("no rank passed is_main_process=True", where=_WHERE,
                         hint="pass is_main_process=True on one rank (or leave it out: "
                              "rank 0)")
    return flags.index(True)


def _all_gather(obj: Any) -> list[Any]:
    _, world = _rank_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any, src: int) -> Any:
    _, world = _rank_world()
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
