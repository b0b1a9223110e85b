"""DeepSpeed's ``zero_to_fp32``: a checkpoint consolidated into one fp32 state dict, in memory,
loaded into a model, or written as ``pytorch_model.bin`` / ``model.safetensors`` (sharded
with Hugging Face's naming and index when it passes ``max_shard_size``).

The consolidation itself is :func:`deepshard.runtime.checkpoint.consolidate.
get_fp32_state_dict` (any stage, precision, world size or model-parallel layout); this module
adds DeepSpeed's signatures, the files, and the command line DeepSpeed's script has::

    python -m deepshard.runtime.checkpoint.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR
        [--safe_serialization] [--max_shard_size 5GB] [-t TAG] [--exclude_frozen_parameters]

``CHECKPOINT_DIR`` is the directory given to ``engine.save_checkpoint`` (holding ``latest``
and the tag directories), as in DeepSpeed. :func:`write_script` puts a launcher of that
command next to the checkpoints (``zero_to_fp32.py``, where DeepSpeed puts its script).
:func:`get_optim_files` and :func:`get_model_state_file` name a checkpoint's files for
code that reads them itself (deepshard's names: ``model_states.pt``, ``rank_00000.pt``...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from deepshard.errors import EXIT_USAGE, UsageError, UsageValueError, render
from deepshard.runtime.checkpoint import ds_files, from_deepspeed
from deepshard.runtime.checkpoint import format as fmt
from deepshard.runtime.checkpoint.consolidate import get_fp32_state_dict

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "get_model_state_file",
           "get_optim_files", "load_state_dict_from_zero_checkpoint", "main", "write_script"]

OUTPUT_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32,
                      "float16": torch.float16, "fp16": torch.float16,
                      "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
"""The output dtypes DeepSpeed's converter accepts, by name."""
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
"""``max_shard_size`` units, decimal as in ``huggingface_hub``."""


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike,
                                             tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The model's whole state dict in fp32 from the checkpoints in ``checkpoint_dir``.

    ``tag`` defaults to the one ``latest`` names (else the newest complete one).
    ``exclude_frozen_parameters`` leaves out the parameters that did not require grad (the
    checkpoint must record them). ``lazy_mode`` is accepted: the values are plain tensors
    on the CPU, whose ``.contiguous()`` DeepSpeed's lazy values also offer.

    Raises:
        UsageError: no complete checkpoint (or no ``tag``) there, or frozen parameters to
            exclude that the checkpoint does not record.
    """
    del lazy_mode  # see the docstring
    state = get_fp32_state_dict(checkpoint_dir, tag)
    if exclude_frozen_parameters:
        frozen = _frozen_names(Path(checkpoint_dir), tag)
        state = {name: value for name, value in state.items() if name not in frozen}
    return state


def _frozen_names(checkpoint_dir: Path, tag: str | None) -> set[str]:
    ds_tag = ds_files.find_tag(checkpoint_dir, tag)
    if ds_tag is not None:
        return from_deepspeed.frozen_names(ds_tag)
    manifest = fmt.resolve_tag(checkpoint_dir, tag)
    if manifest is None or manifest.frozen_excluded:  # saved without them already
        return set()
    shared = fmt.load_file(checkpoint_dir / manifest.tag, fmt.SHARED_FILE, mmap=True)
    names = shared.get("frozen_names")
    if names is None:
        raise UsageError("this checkpoint does not record which parameters were frozen",
                         where=str(checkpoint_dir / manifest.tag),
                         hint="convert it without exclude_frozen_parameters, or save with "
                              "engine.save_checkpoint(..., exclude_frozen_parameters=True)")
    return set(names)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> torch.nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's fp32 state into it
    (``strict=False``, as DeepSpeed does); returns the model."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str | os.PathLike,
                                          output_dir: str | os.PathLike,
                                          dtype: torch.dtype | str = torch.float32,
                                          max_shard_size: int | str | None = "5GB",
                                          safe_serialization: bool = False,
                                          tag: str | None = None,
                                          exclude_frozen_parameters: bool = False) -> list[Path]:
    """Write the consolidated state into ``output_dir`` (created): ``pytorch_model.bin``
    (``torch.save``) or, with ``safe_serialization``, ``model.safetensors`` (needs the
    ``safetensors`` package). Past ``max_shard_size`` bytes (``"5GB"``, an int, or ``None``
    for one file) the tensors are split in order into ``pytorch_model-00001-of-0000N.bin``...
    with a ``pytorch_model.bin.index.json`` (Hugging Face's names). Floating tensors are
    cast to ``dtype``; others keep theirs. Returns the files written."""
    dtype = resolve_output_dtype(dtype)
    save_file = _writer(safe_serialization)
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag,
                                                     exclude_frozen_parameters)
    state = _compact(state, dtype)
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    shards = split_in_shards(state, limit)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = shard_names(weights, len(shards))
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, out / name)
    written = [out / name for name in names]
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(t) for t in _unique(state))},
                 "weight_map": {k: name for name, shard in zip(names, shards, strict=True)
                                for k in shard}}
        written.append(out / f"{weights}.index.json")
        written[-1].write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return written


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike,
                                               output_dir: str | os.PathLike,
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False,
                                               tag: str | None = None,
                                               exclude_frozen_parameters: bool = False
                                               ) -> list[Path]:
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's older name)."""
    return convert_zero_checkpoint_to_state_dict(
        checkpoint_dir, output_dir, dtype=torch.float32, max_shard_size=max_shard_size,
        safe_serialization=safe_serialization, tag=tag,
        exclude_frozen_parameters=exclude_frozen_parameters)


# -- a checkpoint's files -----------------------------------------------------------------


class CheckpointFileNotFoundError(UsageError, FileNotFoundError):
    """A checkpoint file or directory that is not there (a ``FileNotFoundError``, as
    DeepSpeed raises)."""


def _tag_dir(checkpoint_dir: str | os.PathLike) -> tuple[Path, fmt.Manifest]:
    """A tag directory (given, or the one ``latest`` names in a save directory) and its
    manifest."""
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise CheckpointFileNotFoundError("directory doesn't exist", where=str(path),
                                          hint="pass a checkpoint tag directory, or the "
                                               "directory given to save_checkpoint")
    manifest = fmt.read_manifest(path) or fmt.resolve_tag(path, None)
    if manifest is None:
        raise CheckpointFileNotFoundError(
            "no complete deepshard checkpoint here", where=str(path),
            hint="pass a tag directory (holding manifest.json) or the save directory")
    return (path if (path / fmt.MANIFEST).is_file() else path / manifest.tag), manifest


def _existing(path: Path) -> str:
    if not path.is_file():
        raise CheckpointFileNotFoundError("checkpoint file is missing", where=str(path),
                                          hint="the checkpoint is incomplete: load an "
                                               "older tag")
    return str(path)


def get_optim_files(checkpoint_dir: str | os.PathLike) -> list[str]:
    """The files holding each rank's part of the optimizer state, in rank order: the
    rank files (``rank_00000.pt``...) of a ZeRO checkpoint, where DeepSpeed has its
    ``*_optim_states.pt`` (a pipeline's stage by stage, an MoE model's ``expp_rank_*``
    last). ``checkpoint_dir`` is a tag directory or a save directory
    (then the tag ``latest`` names).

    Raises:
        CheckpointFileNotFoundError: no checkpoint or a file missing there, or a stage 0
            checkpoint (its optimizer state is in :func:`get_model_state_file`, as
            DeepSpeed's is in its model states file).
    """
    ds_tag = _deepspeed_tag(checkpoint_dir)
    if ds_tag is not None:
        found = ds_files.files(ds_tag)
        optim = [p for s in found.stages or (found,) for p in s.optim] + \
            list(found.expert_optim)
        if not optim:
            raise CheckpointFileNotFoundError(
                "a ZeRO stage 0 checkpoint has no per-rank optimizer files",
                where=str(ds_tag), hint=f"the optimizer state is in {ds_files.model_file()}")
        return [str(p) for p in optim]
    tag_dir, manifest = _tag_dir(checkpoint_dir)
    if manifest.zero_stage == 0:
        raise CheckpointFileNotFoundError(
            "a ZeRO stage 0 checkpoint has no per-rank optimizer files", where=str(tag_dir),
            hint=f"the optimizer state is in {fmt.SHARED_FILE} "
                 "(get_model_state_file(checkpoint_dir, 0))")
    return [_existing(tag_dir / name) for name in manifest.files if name != fmt.SHARED_FILE]


def get_model_state_file(checkpoint_dir: str | os.PathLike, zero_stage: int) -> str:
    """The checkpoint's shared file, ``model_states.pt`` (module state, optimizer
    hyperparameters, scheduler, counters, client state), where DeepSpeed has its
    ``mp_rank_00_model_states.pt``: deepshard names it the same at every ZeRO stage.

    Raises:
        UsageValueError: ``zero_stage`` is not 0-3.
        CheckpointFileNotFoundError: no checkpoint, or the file missing there.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise UsageValueError(f"zero_stage {zero_stage!r} is not a ZeRO stage",
                              where="get_model_state_file", hint="pass 0, 1, 2 or 3")
    ds_tag = _deepspeed_tag(checkpoint_dir)
    if ds_tag is not None:
        return str(ds_files.files(ds_tag).model[0])
    tag_dir, _ = _tag_dir(checkpoint_dir)
    return _existing(tag_dir / fmt.SHARED_FILE)


def _deepspeed_tag(checkpoint_dir: str | os.PathLike) -> Path | None:
    """A DeepSpeed tag directory given, or named by ``latest`` in the directory given."""
    path = Path(checkpoint_dir)
    if path.is_dir() and ds_files.is_deepspeed_tag(path):
        return path
    return ds_files.find_tag(path, None)


# -- output files ------------------------------------------------------------------------


def resolve_output_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32``/``"fp32"``/``"torch.bfloat16"``... as a dtype; ``ValueError`` for
    another (DeepSpeed's rule)."""
    value = dtype
    if isinstance(dtype, str):
        value = OUTPUT_DTYPE_NAMES.get(dtype.removeprefix("torch.").lower())
    if value not in OUTPUT_DTYPE_NAMES.values():
        raise ValueError(f"Unsupported output dtype {dtype!r}. Choose one of: "
                         f"{', '.join(sorted(OUTPUT_DTYPE_NAMES))}")
    return value


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int or a string of digits, or digits and a decimal unit
    (``"5GB"``, ``"500MB"``)."""
    if isinstance(size, int):
        return size
    text = size.strip()
    if text.isdigit():
        return int(text)
    unit = text[-2:].upper()
    if unit not in SIZE_UNITS:
        raise ValueError(f"unit {unit!r} of max_shard_size {size!r} is not one of "
                         f"{', '.join(SIZE_UNITS)}")
    try:
        return int(float(text[:-2].strip()) * SIZE_UNITS[unit])
    except ValueError:
        raise ValueError(f"cannot read a number in max_shard_size {size!r}") from None


def split_in_shards(state: Mapping[str, torch.Tensor], limit: int | None
                    ) -> list[dict[str, torch.Tensor]]:
    """``state`` cut in order into shards of at most ``limit`` bytes (``None``: one), as
    ``huggingface_hub`` cuts: a tensor bigger than ``limit`` gets a shard of its own, and a
    tensor under several names (tied weights) stays in its first name's shard."""
    shards: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    home: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        key = id(tensor)
        if key in home:
            home[key][name] = tensor
            continue
        n = _nbytes(tensor)
        if limit is not None and n > limit:
            shards.append({name: tensor})
            home[key] = shards[-1]
            continue
        if limit is not None and current and size + n > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        home[key] = current
        size += n
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(weights: str, count: int) -> list[str]:
    """``pytorch_model.bin``, or ``pytorch_model-00001-of-00003.bin``... for ``count`` files."""
    if count == 1:
        return [weights]
    stem, dot, ext = weights.rpartition(".")
    return [f"{stem}-{i:05d}-of-{count:05d}{dot}{ext}" for i in range(1, count + 1)]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _compact(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors in ``dtype``, each in storage of its own size (a view into a larger
    buffer would be saved with all of it); a tensor under several names stays one."""
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, value in state.items():
        if id(value) not in done:
            t = value.to(dtype) if torch.is_floating_point(value) else value
            if t.untyped_storage().nbytes() != _nbytes(t) or not t.is_contiguous():
                t = t.contiguous().clone()
            done[id(value)] = t
        out[name] = done[id(value)]
    return out


def _unique(state: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for tensor in state.values():
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _writer(safe_serialization: bool):
    if not safe_serialization:
        return lambda shard, path: torch.save(shard, path)
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UsageError("safe_serialization needs the safetensors package",
                         where="safe_serialization",
                         hint="pip install safetensors, or write pytorch_model.bin "
                              "(without --safe_serialization)") from None

    def write(shard: dict[str, torch.Tensor], path: Path) -> None:
        # safetensors refuses tensors sharing memory (tied weights): give each its own
        seen: set[int] = set()
        own = {}
        for name, t in shard.items():
            own[name] = t.clone() if id(t) in seen else t
            seen.add(id(t))
        save_file(own, str(path), metadata={"format": "pt"})

    return write


# -- command line and the script next to the checkpoints -------------------------------------


def parser() -> argparse.ArgumentParser:
    """DeepSpeed's ``zero_to_fp32.py`` arguments."""
    p = argparse.ArgumentParser(
        prog="zero_to_fp32.py",
        description="Consolidate the deepshard checkpoints in CHECKPOINT_DIR into one fp32 "
                    "state dict (DeepSpeed's zero_to_fp32.py arguments).")
    p.add_argument("checkpoint_dir", type=str,
                   help="the directory given to save_checkpoint, e.g. path/checkpoint-12")
    p.add_argument("output_dir", type=str,
                   help="directory for the fp32 state_dict files, e.g. path/checkpoint-12-output/")
    p.add_argument("--max_shard_size", type=str, default="5GB",
                   help="largest shard before splitting (digits and KB/MB/GB/TB, e.g. 5GB)")
    p.add_argument("--safe_serialization", default=False, action="store_true",
                   help="write model.safetensors instead of pytorch_model.bin")
    p.add_argument("-t", "--tag", type=str, default=None,
                   help="checkpoint tag, e.g. global_step1 (default: the one 'latest' names)")
    p.add_argument("--exclude_frozen_parameters", action="store_true",
                   help="exclude frozen parameters")
    p.add_argument("-d", "--debug", action="store_true", help="accepted; no effect")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: convert, print the files written; a usage error is one line on
    stderr and exit code 2."""
    args = parser().parse_args(argv)
    try:
        written = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (UsageError, ValueError) as exc:
        err = exc if isinstance(exc, UsageError) else UsageError(str(exc))
        print(render(err), file=sys.stderr)
        return EXIT_USAGE
    for path in written:
        print(f"wrote {path}")
    return 0


SCRIPT_NAME = "zero_to_fp32.py"
SCRIPT = '''#!/usr/bin/env python
"""Consolidate the deepshard checkpoints in this directory into one fp32 state dict.

Written here by deepshard's save_checkpoint, as DeepSpeed writes its zero_to_fp32.py, and
taking DeepSpeed's arguments:

    python zero_to_fp32.py . output_dir/ [--safe_serialization] [--max_shard_size 5GB] [-t TAG]

The work is done by deepshard.runtime.checkpoint.zero_to_fp32: deepshard must be importable.
"""

import sys

from deepshard.runtime.checkpoint.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
'''


def write_script(save_dir: str | os.PathLike) -> Path:
    """Put the ``zero_to_fp32.py`` launcher into ``save_dir`` (a checkpoint root), executable,
    replacing it atomically (an unchanged one is left alone). Returns its path; an
    ``OSError`` from the file system propagates."""
    root = Path(save_dir)
    target = root / SCRIPT_NAME
    try:
        if target.read_text() == SCRIPT:
            return target
    except OSError:
        pass
    tmp = root / f".{SCRIPT_NAME}.{os.getpid()}.tmp"
    try:
        tmp.write_text(SCRIPT)
        tmp.chmod(0o755)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


if __name__ == "__main__":
    sys.exit(main())
