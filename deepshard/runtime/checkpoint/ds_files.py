"""DeepSpeed's checkpoint files: their names, how a tag directory of them is recognised,
and reading them without DeepSpeed installed.

A DeepSpeed tag directory (``global_step1000/``) holds, per model-parallel rank ``M``:
``mp_rank_MM_model_states.pt`` (stages 0-2: the module, schedule, counters, client state),
``zero_pp_rank_R_mp_rank_MM_model_states.pt`` (stage 3, one per data-parallel rank),
``[bf16_]zero_pp_rank_R_mp_rank_MM_optim_states.pt`` (stages 1-3 and bf16 stage 0: each
rank's flat fp32 partition and optimizer state), ``layer_NN-model_MM-model_states.pt``
(pipelines: one per layer) and ``[layer_L_]expert_E_mp_rank_MM_model_states.pt`` (MoE).
The save directory has ``latest`` naming the newest tag, as deepshard's has.

DeepSpeed pickles a few of its own objects into these files (its loss scaler, a stage
enum, fragment addresses). :func:`load` reads them as :class:`Foreign` stand-ins keeping
their attributes, so neither DeepSpeed nor deepshard's ``deepspeed`` alias is needed.
"""

from __future__ import annotations

import os
import pickle
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepshard.errors import UsageError

LATEST = "latest"
MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
LAYER = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
EXPERT = re.compile(r"^(?:layer_(\d+)_)?expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def model_file(mp_rank: int = 0) -> str:
    """Stages 0-2: the model states of one model-parallel rank."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero3_model_file(dp_rank: int, mp_rank: int = 0) -> str:
    """Stage 3: one data-parallel rank's model states."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def optim_file(dp_rank: int, mp_rank: int = 0, bf16: bool = False) -> str:
    """One data-parallel rank's optimizer partition."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def is_deepspeed_tag(tag_dir: Path) -> bool:
    """Whether ``tag_dir`` holds a DeepSpeed checkpoint (by its files)."""
    if (tag_dir / model_file()).is_file() or (tag_dir / zero3_model_file(0)).is_file():
        return True
    return any(pattern.match(p.name) for p in _listing(tag_dir)
               for pattern in (MODEL, ZERO3_MODEL, OPTIM, LAYER))


def find_tag(load_dir: str | os.PathLike, tag: str | None) -> Path | None:
    """The DeepSpeed tag directory a load of ``load_dir`` (and ``tag``, else the one
    ``latest`` names) means, or ``None`` when that is not a DeepSpeed checkpoint."""
    root = Path(load_dir)
    if tag is None:
        try:
            tag = (root / LATEST).read_text().strip()
        except OSError:
            return None
    if not tag or "/" in tag:
        return None
    path = root / tag
    return path if path.is_dir() and is_deepspeed_tag(path) else None


def _listing(tag_dir: Path) -> list[Path]:
    try:
        return sorted(tag_dir.iterdir())
    except OSError:
        return []


class Foreign:
    """A DeepSpeed object read without DeepSpeed: ``ds_class`` names its class, ``args``
    holds what it was built from (an enum's value), its attributes are its state."""

    ds_class = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            self.__dict__.update(state[0] or {})
            self.__dict__.update(state[1])
        else:
            self.__dict__["state"] = state

    @property
    def value(self) -> Any:
        """An enum's value."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<{self.ds_class} {self.__dict__}>"


def _pickle_module() -> types.ModuleType:
    """A ``pickle`` look-alike for ``torch.load`` whose unpickler reads DeepSpeed's
    classes as :class:`Foreign` subclasses (one per class name, made per load)."""
    made: dict[str, type] = {}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module == "deepspeed" or module.startswith("deepspeed."):
                key = f"{module}.{name}"
                if key not in made:
                    made[key] = type(name, (Foreign,), {"ds_class": key})
                return made[key]
            return super().find_class(module, name)

    mod = types.ModuleType("deepshard_ds_pickle")
    mod.Unpickler = Unpickler  # type: ignore[attr-defined]
    mod.load = pickle.load  # type: ignore[attr-defined]
    mod.__dict__["dumps"] = pickle.dumps
    return mod


def load(path: Path, mmap: bool = True) -> dict:
    """One DeepSpeed checkpoint file, tensors on the CPU (``mmap``: read when used).

    Raises:
        UsageError: the file is missing or damaged (one line naming it).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap,
                          pickle_module=_pickle_module())
    except FileNotFoundError:
        raise UsageError("a file of this DeepSpeed checkpoint is missing", where=str(path),
                         hint="copy the whole tag directory (every rank's files)") from None
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise UsageError(f"cannot read this DeepSpeed checkpoint file ({exc})",
                         where=str(path), hint="the checkpoint is damaged: load another "
                                               "tag") from None


@dataclass(frozen=True)
class Files:
    """The files of one DeepSpeed tag directory (data parallelism only)."""

    tag_dir: Path
    model: tuple[Path, ...]    # stage 3: one per data-parallel rank; else one
    optim: tuple[Path, ...]    # by data-parallel rank; empty at stage 0 (fp32)


def files(tag_dir: Path) -> Files:
    """What ``tag_dir`` holds, checked to be one complete checkpoint.

    Raises:
        UsageError: a rank's file missing, files of two world sizes / precisions, or a
            layout not read yet (tensor-parallel ranks, pipeline layer files, MoE expert
            files): one line naming the tag directory and what is wrong.
    """
    names = [p.name for p in _listing(tag_dir)]
    zero3 = sorted((int(m[1]), int(m[2])) for n in names if (m := ZERO3_MODEL.match(n)))
    plain = sorted(int(m[1]) for n in names if (m := MODEL.match(n)))
    optim = sorted((int(m[2]), int(m[3]), bool(m[1])) for n in names if (m := OPTIM.match(n)))
    mp_ranks = max([*plain, *(m for _, m in zero3), *(m for _, m, _ in optim), 0]) + 1
    if mp_ranks > 1:
        raise UsageError(f"this DeepSpeed checkpoint was saved with {mp_ranks} model-"
                         "parallel (tensor) ranks", where=str(tag_dir),
                         hint="convert it to a universal checkpoint (python -m "
                              "deepspeed.checkpoint.ds_to_universal) and load that with "
                              "checkpoint.load_universal")
    if len({bf16 for _, _, bf16 in optim}) > 1:
        raise UsageError("this DeepSpeed tag directory mixes bf16_ and fp32 optimizer files",
                         where=str(tag_dir), hint="keep the files of one save only")
    model = [tag_dir / zero3_model_file(r) for r, _ in zero3] if zero3 else \
        [tag_dir / model_file()] if plain else []
    _check_ranks(tag_dir, [r for r, _ in zero3], "zero_pp_rank_{}_mp_rank_00_model_states.pt")
    prefix = "bf16_" if optim and optim[0][2] else ""
    _check_ranks(tag_dir, [r for r, _, _ in optim],
                 prefix + "zero_pp_rank_{}_mp_rank_00_optim_states.pt")
    if zero3 and optim and len(optim) != len(zero3):
        lacking = sorted({r for r, _ in zero3} ^ {r for r, _, _ in optim})[0]
        what = optim_file(lacking, 0, bool(prefix)) if len(optim) < len(zero3) else \
            zero3_model_file(lacking)
        raise UsageError(f"{len(zero3)} stage 3 model files but {len(optim)} optimizer "
                         f"files: {what} is missing", where=str(tag_dir),
                         hint="copy the whole tag directory (every rank's files); files of "
                              "two saves must not be mixed")
    layers = sorted(n for n in names if LAYER.match(n))
    experts = sorted(n for n in names if EXPERT.match(n))
    if layers or experts:
        kind = "pipeline layer" if layers else "MoE expert"
        raise UsageError(f"DeepSpeed {kind} files ({(layers or experts)[0]}...) are not "
                         "read yet", where=str(tag_dir),
                         hint="load it in DeepSpeed and save its consolidated weights "
                              "(zero_to_fp32) to start from, or resume in DeepSpeed")
    if not model:
        raise UsageError("no DeepSpeed model states file", where=str(tag_dir),
                         hint=f"the directory should hold {model_file()} (or, at stage 3, "
                              f"{zero3_model_file(0)})")
    return Files(tag_dir, tuple(model), tuple(tag_dir / optim_file(r, 0, bool(b))
                                                for r, _, b in optim))


def _check_ranks(tag_dir: Path, ranks: list[int], pattern: str) -> None:
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks)) if ranks else []
    if missing:
        raise UsageError(f"{pattern.format(missing[0])} is missing ({len(missing)} rank "
                         f"file(s) of {max(ranks) + 1})", where=str(tag_dir),
                         hint="copy the whole tag directory (every rank's files)")
