"""DeepSpeed's checkpoint files: their names, how a tag directory of them is recognised,
and reading them without DeepSpeed installed.

A DeepSpeed tag directory (``global_step1000/``) holds, per model-parallel rank ``M``
(a pipeline's stage; tensor-parallel ranks are not read):
``mp_rank_MM_model_states.pt`` (stages 0-2: the module, schedule, counters, client state;
a pipeline stage's has no module but its ``param_shapes``),
``zero_pp_rank_R_mp_rank_MM_model_states.pt`` (stage 3, one per data-parallel rank),
``[bf16_]zero_pp_rank_R_mp_rank_MM_optim_states.pt`` (stages 1-3 and bf16 stage 0: each
rank's flat fp32 partition and optimizer state); pipelines add ``layer_NN-model_states.pt``
(one per layer holding state, its own ``state_dict()``: keys without the global index;
``layer_NN-model_TT-model_states.pt`` with tensor parallelism), MoE models
``layer_L_expert_E_mp_rank_MM_model_states.pt`` (MoE layer ``L``'s global expert ``E``,
under the module's names) and, without ZeRO, ``expp_rank_P_mp_rank_MM_optim_states.pt``
(expert-parallel rank ``P``'s optimizer state).
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
LAYER = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
EXPERT = re.compile(r"^(?:layer_(\d+)_)?expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
EXPERT_OPTIM = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def model_file(mp_rank: int = 0) -> str:
    """Stages 0-2: the model states of one model-parallel rank."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero3_model_file(dp_rank: int, mp_rank: int = 0) -> str:
    """Stage 3: one data-parallel rank's model states."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def optim_file(dp_rank: int, mp_rank: int = 0, bf16: bool = False) -> str:
    """One data-parallel rank's optimizer partition."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def layer_file(index: int) -> str:
    """Pipelines: one layer's module state (``index``: its global index)."""
    return f"layer_{index:02d}-model_states.pt"


def expert_file(layer: int, expert: int, mp_rank: int = 0) -> str:
    """MoE: one expert's parameters (``layer``: the MoE layer's number in module order,
    ``expert``: its global id)."""
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def expert_optim_file(ep_rank: int, mp_rank: int = 0) -> str:
    """MoE without ZeRO: one expert-parallel rank's optimizer state."""
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def is_deepspeed_tag(tag_dir: Path) -> bool:
    """Whether ``tag_dir`` holds a DeepSpeed checkpoint (by its files)."""
    if (tag_dir / model_file()).is_file() or (tag_dir / zero3_model_file(0)).is_file():
        return True
    return any(pattern.match(p.name) for p in _listing(tag_dir)
               for pattern in (MODEL, ZERO3_MODEL, OPTIM, LAYER, EXPERT))


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
    """The files of one DeepSpeed tag directory. ``model`` and ``optim`` are pipeline
    stage 0's (model-parallel rank 0's); a pipeline has one :class:`Files` per stage in
    ``stages`` and its layers' files in ``layers``; an MoE model its experts' files in
    ``experts``."""

    tag_dir: Path
    model: tuple[Path, ...]    # stage 3: one per data-parallel rank; else one
    optim: tuple[Path, ...]    # by data-parallel rank; empty at stage 0 (fp32)
    layers: tuple[tuple[int, Path], ...] = ()   # pipeline: (global layer index, file)
    stages: tuple[Files, ...] = ()              # pipeline: every stage's, stage 0 first
    experts: tuple[tuple[int, int, Path], ...] = ()  # MoE: (layer, global expert, file)
    expert_optim: tuple[Path, ...] = ()         # MoE without ZeRO: by expert-parallel rank


def files(tag_dir: Path) -> Files:
    """What ``tag_dir`` holds, checked to be one complete checkpoint.

    Raises:
        UsageError: a rank's or stage's file missing, files of two world sizes /
            precisions, or a layout not read (tensor-parallel ranks, a pipeline with MoE
            layers): one line naming the tag directory and what is wrong.
    """
    names = [p.name for p in _listing(tag_dir)]
    layers = sorted((int(m[1]), n) for n in names if (m := LAYER.match(n)))
    if any(m[2] is not None for n in names if (m := LAYER.match(n))):
        raise _tensor_parallel(tag_dir, "pipeline layer files of several tensor-parallel "
                                        "ranks (layer_NN-model_TT-...)")
    if len({bool(m[1]) for n in names if (m := OPTIM.match(n))}) > 1:
        raise UsageError("this DeepSpeed tag directory mixes bf16_ and fp32 optimizer files",
                         where=str(tag_dir), hint="keep the files of one save only")
    mp_ranks = max([int(m[1]) for n in names if (m := MODEL.match(n))]
                   + [int(m[2]) for n in names if (m := ZERO3_MODEL.match(n))]
                   + [int(m[3]) for n in names if (m := OPTIM.match(n))] + [0]) + 1
    if mp_ranks > 1 and not layers:
        raise _tensor_parallel(tag_dir, f"{mp_ranks} model-parallel (tensor) ranks")
    stages = tuple(_rank_files(tag_dir, names, s) for s in range(mp_ranks))
    _check_stages(tag_dir, stages)
    experts = _experts(tag_dir, names)
    if layers and experts:  # each stage numbers its own MoE layers, in its own mp_rank
        raise UsageError("DeepSpeed pipeline checkpoints with MoE layers are not read",
                         where=str(tag_dir),
                         hint="resume it in DeepSpeed, or start from its consolidated "
                              "weights")
    expert_optim = sorted(int(m[1]) for n in names if (m := EXPERT_OPTIM.match(n)))
    _check_ranks(tag_dir, expert_optim, "expp_rank_{}_mp_rank_00_optim_states.pt")
    first = stages[0]
    return Files(tag_dir, first.model, first.optim,
                 tuple((i, tag_dir / n) for i, n in layers), stages if layers else (),
                 experts, tuple(tag_dir / expert_optim_file(r) for r in expert_optim))


def _tensor_parallel(tag_dir: Path, what: str) -> UsageError:
    return UsageError(f"this DeepSpeed checkpoint was saved with {what}", where=str(tag_dir),
                      hint="convert it to a universal checkpoint (python -m "
                           "deepspeed.checkpoint.ds_to_universal) and load that with "
                           "checkpoint.load_universal")


def _rank_files(tag_dir: Path, names: list[str], mp: int) -> Files:
    """Model-parallel rank ``mp``'s (a pipeline stage's) model and optimizer files."""
    zero3 = sorted(int(m[1]) for n in names if (m := ZERO3_MODEL.match(n)) and int(m[2]) == mp)
    plain = any((m := MODEL.match(n)) and int(m[1]) == mp for n in names)
    optim = sorted((int(m[2]), bool(m[1])) for n in names
                   if (m := OPTIM.match(n)) and int(m[3]) == mp)
    bf16 = bool(optim) and optim[0][1]
    _check_ranks(tag_dir, zero3, zero3_model_file(0, mp).replace("rank_0_", "rank_{}_", 1))
    _check_ranks(tag_dir, [r for r, _ in optim],
                 optim_file(0, mp, bf16).replace("rank_0_", "rank_{}_", 1))
    if zero3 and optim and len(optim) != len(zero3):
        lacking = sorted(set(zero3) ^ {r for r, _ in optim})[0]
        what = optim_file(lacking, mp, bf16) if len(optim) < len(zero3) else \
            zero3_model_file(lacking, mp)
        raise UsageError(f"{len(zero3)} stage 3 model files but {len(optim)} optimizer "
                         f"files: {what} is missing", where=str(tag_dir),
                         hint="copy the whole tag directory (every rank's files); files of "
                              "two saves must not be mixed")
    model = [tag_dir / zero3_model_file(r, mp) for r in zero3] if zero3 else \
        [tag_dir / model_file(mp)] if plain else []
    if not model:
        what = "no DeepSpeed model states file" if mp == 0 else \
            f"{model_file(mp)} is missing (pipeline stage {mp}'s model states)"
        raise UsageError(what, where=str(tag_dir),
                         hint=f"the directory should hold {model_file(mp)} (or, at stage 3, "
                              f"{zero3_model_file(0, mp)})" if mp == 0 else
                         "copy the whole tag directory (every stage's files)")
    return Files(tag_dir, tuple(model), tuple(tag_dir / optim_file(r, mp, b) for r, b in optim))


def _check_stages(tag_dir: Path, stages: tuple[Files, ...]) -> None:
    """Every pipeline stage has as many optimizer files as the first."""
    for s, found in enumerate(stages[1:], 1):
        have, want = len(found.optim), len(stages[0].optim)
        if have != want:
            short, count = (s, have) if have < want else (0, want)
            bf16 = (found.optim or stages[0].optim)[0].name.startswith("bf16_")
            raise UsageError(f"{optim_file(count, short, bf16)} is missing (pipeline stage "
                             f"{s} has {have} optimizer files, stage 0 {want})",
                             where=str(tag_dir),
                             hint="copy the whole tag directory (every stage's files)")


def _experts(tag_dir: Path, names: list[str]) -> tuple[tuple[int, int, Path], ...]:
    """The MoE expert files (layer, global expert id, path), checked to number each
    layer's experts from 0 without gaps (the reader checks the count)."""
    found: dict[int, list[int]] = {}
    for n in names:
        m = EXPERT.match(n)
        if m is None:
            continue
        if m[1] is None:
            raise UsageError(f"{n} is an MoE expert file of a DeepSpeed older than 0.5 (no "
                             "layer_N_ prefix), which deepshard does not read",
                             where=str(tag_dir), hint="load it in that DeepSpeed and save it "
                                                      "again with a current one")
        if int(m[3]) != 0:
            raise _tensor_parallel(tag_dir, "MoE expert files of several model-parallel ranks")
        found.setdefault(int(m[1]), []).append(int(m[2]))
    for layer, ids in sorted(found.items()):
        _check_ranks(tag_dir, ids, f"layer_{layer}_expert_{{}}_mp_rank_00_model_states.pt")
    return tuple((layer, e, tag_dir / expert_file(layer, e))
                 for layer, ids in sorted(found.items()) for e in sorted(ids))


def _check_ranks(tag_dir: Path, ranks: list[int], pattern: str) -> None:
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks)) if ranks else []
    if missing:
        raise UsageError(f"{pattern.format(missing[0])} is missing ({len(missing)} rank "
                         f"file(s) of {max(ranks) + 1})", where=str(tag_dir),
                         hint="copy the whole tag directory (every rank's files)")
