"""DeepSpeed's universal checkpoints: written from DeepSpeed's or deepshard's checkpoints
(``ds_to_universal``), and read into the by-name form for ``checkpoint.load_universal``.

A universal tag directory holds the model states file(s) of the checkpoint it came from
and ``zero/<parameter name>/`` per parameter: ``fp32.pt`` (``{"param": tensor,
"cat_dim": 0}``), one file per optimizer state tensor (``exp_avg.pt``...) and ``step.pt``;
``zero/optimizer_state.pt`` keeps the optimizer's hyperparameters and loss scaler. The
save directory's ``latest_universal`` names the tag. Every value is whole, so any world
size, stage, tensor or pipeline layout loads it.

Unlike DeepSpeed 0.19.8's converter, this one needs no ``--inject_missing_state`` for
ZeRO-2, writes whatever state tensors the optimizer keeps (any torch optimizer's), and
converts deepshard's own checkpoints too. It reads each rank's file once and writes the
per-parameter files from a thread pool (``--num_extract_workers``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from deepshard.contract import DEEPSHARD_VERSION, DEEPSPEED_VERSION
from deepshard.errors import EXIT_USAGE, UsageError, render
from deepshard.runtime.checkpoint import ds_files, ds_partitions, from_deepspeed
from deepshard.runtime.checkpoint import format as fmt
from deepshard.runtime.checkpoint.by_name import ByName, Needed, read_by_name

LATEST_UNIVERSAL = "latest_universal"
ZERO = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
PARAM = "param"
CAT_DIM = "cat_dim"
WRITTEN_VERSION = f"{DEEPSPEED_VERSION}+deepshard.{DEEPSHARD_VERSION}"
"""``ds_version`` of the files written here: DeepSpeed's loader parses and checks it."""


def is_universal_tag(tag_dir: Path) -> bool:
    """Whether ``tag_dir`` is a universal checkpoint (it has ``zero/`` per parameter)."""
    return (tag_dir / ZERO / OPTIMIZER_STATE).is_file()


def find_tag(load_dir: str | os.PathLike, tag: str | None) -> Path | None:
    """The universal tag a ``load_universal`` load of ``load_dir`` means (``tag``, else
    ``latest_universal``, else ``latest``), or ``None``."""
    root = Path(load_dir)
    if tag is None:
        for pointer in (LATEST_UNIVERSAL, ds_files.LATEST):
            try:
                tag = (root / pointer).read_text().strip()
                break
            except OSError:
                continue
    if not tag or "/" in tag:
        return None
    path = root / tag
    return path if is_universal_tag(path) else None


# -- reading ---------------------------------------------------------------------------
def read(tag_dir: Path, need: Needed | None = None) -> from_deepspeed.Loaded:
    """A universal checkpoint in deepshard's load form (see :mod:`.from_deepspeed`);
    ``need``: read only these names' values and state (default: all).

    Raises:
        UsageError: a parameter folder without its ``fp32.pt``, a damaged file, or no
            model states file beside ``zero/`` (one line naming it).
    """
    found = ds_files.files(tag_dir)
    top = ds_files.load(found.model[0])
    zero = tag_dir / ZERO
    common = ds_files.load(zero / OPTIMIZER_STATE, mmap=False)
    out = ByName({})
    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        name = folder.name
        fp32 = folder / "fp32.pt"
        if not fp32.is_file():
            raise UsageError(f"parameter folder {name} has no fp32.pt", where=str(folder),
                             hint="convert the checkpoint again (ds_to_universal)")
        out.present.add(name)
        if need is None or name in need.values:
            out.values[name] = _tensor(ds_files.load(fp32))
        if need is not None and name not in need.state:
            continue
        state, scalars = {}, {}
        for item in sorted(folder.glob("*.pt")):
            if item.name == "fp32.pt":
                continue
            value = _tensor(ds_files.load(item))
            if value.dim() == 0:
                scalars[item.stem] = value
            else:
                state[item.stem] = value
        if state:
            out.state[name] = state
            out.scalars[name] = scalars or _group_scalars(common)
    module = {n: v for n, v in (top.get("module") or {}).items() if v.numel() > 0}
    for name, value in module.items():
        out.values.setdefault(name, value)
    for alias, canonical in (top.get("shared_params") or {}).items():
        if canonical in out.values:
            out.values[alias] = out.values[canonical]
    out.present.update(out.values)
    stage = int(getattr(common.get("zero_stage"), "value", common.get("zero_stage")) or 0)
    return from_deepspeed.loaded(tag_dir, top, out, stage, common.get("param_groups") or [],
                                 ds_partitions.scaler_state(common.get("loss_scaler"), common),
                                 found)


def _tensor(entry: object) -> torch.Tensor:
    if isinstance(entry, Mapping):
        return entry[PARAM]
    if torch.is_tensor(entry):
        return entry
    raise UsageError(f"unexpected universal checkpoint entry {type(entry).__name__}",
                     where="ds_to_universal", hint="convert the checkpoint again")


def _group_scalars(common: Mapping) -> dict:
    """Stage 3's converter keeps ``step`` only in the optimizer state it copies."""
    state = ((common.get("optimizer_state_dict") or {}).get("state") or {}).get(0) or {}
    return {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)}


# -- writing ---------------------------------------------------------------------------
def convert(input_folder: str | os.PathLike, output_folder: str | os.PathLike,
            workers: int = 4) -> Path:
    """Write the universal form of the checkpoint in ``input_folder`` (a DeepSpeed tag
    directory, or a deepshard tag directory holding ``manifest.json``) into
    ``output_folder``, and point ``latest_universal`` beside it at it.

    Raises:
        UsageError: not a checkpoint, or one split over pipeline / tensor-parallel ranks
            or holding MoE experts (not yet converted).
    """
    src, out = Path(input_folder), Path(output_folder)
    if fmt.read_manifest(src) is not None:
        by_name, common, models = _from_deepshard(src)
    elif src.is_dir() and ds_files.is_deepspeed_tag(src):
        found = ds_files.files(src)
        _check_data_parallel(found)
        loaded = from_deepspeed.read(src)
        by_name, models = loaded.by_name, list(found.model)
        common = _common_from_deepspeed(found, loaded)
    else:
        raise UsageError("not a checkpoint tag directory", where=str(src),
                         hint="pass a tag directory (global_step<N>/) of a DeepSpeed or "
                              "deepshard checkpoint as --input_folder")
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / ZERO).mkdir(parents=True)
    jobs: list[tuple[Path, object]] = []
    for name, value in by_name.values.items():
        folder = partial / ZERO / name
        jobs.append((folder / "fp32.pt", {PARAM: value.float(), CAT_DIM: 0}))
        for key, tensor in by_name.state.get(name, {}).items():
            jobs.append((folder / f"{key}.pt", {PARAM: tensor, CAT_DIM: 0}))
        for key, scalar in by_name.scalars.get(name, {}).items():
            if isinstance(scalar, (int, float)) and not isinstance(scalar, bool):
                scalar = torch.tensor(float(scalar))
            if isinstance(scalar, torch.Tensor):
                jobs.append((folder / f"{key}.pt", scalar))
    for folder in {path.parent for path, _ in jobs}:
        folder.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        list(pool.map(lambda job: _save(*job), jobs))
    step = next((sc["step"] for sc in by_name.scalars.values() if "step" in sc), None)
    # DeepSpeed's stage 3 takes the step and hyperparameters from the optimizer state
    common.setdefault("optimizer_state_dict", {
        "state": {0: {"step": step}} if step is not None else {},
        "param_groups": common["param_groups"]})
    _save(partial / ZERO / OPTIMIZER_STATE, common)
    for model in models:
        if isinstance(model, Path):
            shutil.copy2(model, partial / model.name)
        elif common["zero_stage"] == 3:  # DeepSpeed's stage 3 looks for its own names
            for rank in range(model["dp_world_size"]):
                _save(partial / ds_files.zero3_model_file(rank), model)
        else:
            _save(partial / ds_files.model_file(), model)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    tmp = out.parent / f".{LATEST_UNIVERSAL}.tmp"
    tmp.write_text(out.name)
    os.replace(tmp, out.parent / LATEST_UNIVERSAL)
    return out


def _check_data_parallel(found: ds_files.Files) -> None:
    if found.stages or found.experts:
        what = "pipeline" if found.stages else "MoE"
        raise UsageError(f"a DeepSpeed {what} checkpoint is not converted to universal yet",
                         where=str(found.tag_dir),
                         hint="deepshard loads it as it is (engine.load_checkpoint), at any "
                              "pipeline / expert-parallel layout; consolidate it with "
                              "zero_to_fp32 for a single state dict")


def _save(path: Path, value: object) -> None:
    # a view would save its whole flat partition: each file gets its own storage
    if isinstance(value, dict):
        value = {k: v.clone() if torch.is_tensor(v) else v for k, v in value.items()}
    elif isinstance(value, torch.Tensor):
        value = value.clone()
    torch.save(value, path)


def _common_from_deepspeed(found: ds_files.Files, loaded: from_deepspeed.Loaded) -> dict:
    groups = (loaded.shared.get("optimizer") or {}).get("param_groups") or []
    if not found.optim:
        return {"zero_stage": 0, "param_groups": groups, "clip_grad": 0.0, "overflow": False,
                "dynamic_loss_scale": False, "ds_version": WRITTEN_VERSION}
    inner = ds_files.load(found.optim[0])["optimizer_state_dict"]
    common = {k: _plain(v) for k, v in inner.items()
              if k not in ("base_optimizer_state", "single_partition_of_fp32_groups",
                           "param_slice_mappings", "fp32_flat_groups", "loss_scaler",
                           "optimizer_state_dict")}
    common["param_groups"] = groups
    common.update(ds_partitions.scaler_state(inner.get("loss_scaler"), inner) or {})
    return common


def _plain(value: object) -> object:
    """DeepSpeed's enums as their values (written files must load without DeepSpeed)."""
    return value.value if isinstance(value, ds_files.Foreign) else value


def _from_deepshard(src: Path) -> tuple[ByName, dict, list]:
    manifest = fmt.read_manifest(src)
    assert manifest is not None  # checked by the caller
    if manifest.layout:
        raise UsageError("a deepshard checkpoint split over pipeline or tensor-parallel "
                         "ranks is not converted to universal yet", where=str(src),
                         hint="resume it in deepshard at the layout that wrote it, or "
                              "consolidate it (get_fp32_state_dict_from_zero_checkpoint "
                              "merges pipeline stages and tensor slices)")
    shared = fmt.load_file(src, fmt.SHARED_FILE)
    by_name = read_by_name(src, manifest, shared)
    if manifest.zero_stage == 0:
        by_name.values.update({k: v for k, v in fmt.full_precision(shared).items()})
    groups = (shared.get("optimizer") or {}).get("param_groups") or []
    counters = shared.get("counters") or {}
    module = {k: v for k, v in shared["module"].items()}
    module.update({n: v for n, v in by_name.values.items() if n not in module})
    model = {
        "module": module, "buffer_names": [], "optimizer": None,
        "param_shapes": [{n: v.shape for n, v in by_name.values.items()
                          if n in by_name.state}],
        "frozen_param_shapes": None, "shared_params": dict(shared.get("aliases") or {}),
        "lr_scheduler": shared.get("lr_scheduler"), "data_sampler": None, "random_ltd": None,
        "skipped_steps": counters.get("skipped_steps", 0),
        "global_steps": counters.get("global_steps", manifest.global_steps),
        "global_samples": counters.get("global_samples", 0),
        "dp_world_size": manifest.world_size, "mp_world_size": 1,
        "ds_version": WRITTEN_VERSION,
        **dict(shared.get("client_state") or {}),
    }
    scale = shared.get("loss_scaler") or {}
    # no "loss_scaler" object: DeepSpeed then keeps the one its config built
    common = {"zero_stage": manifest.zero_stage, "param_groups": groups, "clip_grad": 0.0,
              "overflow": False, "dynamic_loss_scale": "cur_iter" in scale,
              "ds_version": WRITTEN_VERSION, **scale}
    return by_name, common, [model]


# -- the command -----------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    """DeepSpeed's ``ds_to_universal`` flags (those about its worker processes and
    temporary folder are accepted; ``--inject_missing_state`` is never needed)."""
    p = argparse.ArgumentParser(prog="ds_to_universal", description=__doc__.split("\n")[0])
    p.add_argument("--input_folder", required=True,
                   help="a checkpoint tag directory (DeepSpeed's or deepshard's)")
    p.add_argument("--output_folder", required=True, help="the universal tag directory")
    p.add_argument("--num_extract_workers", type=int, default=4,
                   help="threads writing the per-parameter files")
    p.add_argument("--num_merge_workers", type=int, default=2, help="accepted (unused)")
    p.add_argument("--keep_temp_folder", action="store_true", help="accepted (no temp)")
    p.add_argument("--no_strict", dest="strict", action="store_false",
                   help="accepted (the checks always run)")
    p.add_argument("--inject_missing_state", action="store_true",
                   help="accepted (never needed)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m deepspeed.checkpoint.ds_to_universal``: exit 0, or 2 with one line."""
    args = parser().parse_args(argv)
    try:
        out = convert(args.input_folder, args.output_folder, args.num_extract_workers)
    except UsageError as err:
        print(render(err), file=sys.stderr)
        return EXIT_USAGE
    print(f"universal checkpoint written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
