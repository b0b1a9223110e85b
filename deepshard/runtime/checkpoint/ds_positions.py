"""DeepSpeed's optimizer state without ZeRO (stage 0): a torch optimizer's ``state_dict``,
by position, named here. A data-parallel job's positions are the loading job's optimizer
groups' (DeepSpeed's own load matches them by position too), or, without a job
(consolidation), the module's parameters matched by shape; a pipeline stage's are the next
parameters in global layer order; an MoE model's expert-parallel rank's are its dense
group (the module's parameters) and its MoE group (its local experts', global names).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import ds_files, ds_parallel, ds_partitions
from deepshard.runtime.checkpoint.by_name import ByName


def pipe_stage0(out: ByName, top: Mapping, files: ds_files.Files,
                module: Mapping[str, torch.Tensor], candidates: Sequence[str], start: int
                ) -> tuple[int, list[dict], Path | None]:
    """One pipeline stage's optimizer without ZeRO (fp32: a torch ``state_dict`` by
    position) into ``out``: its positions are the next parameters in global layer order
    (``candidates[start:]``), matched by shape. Returns where the next stage's start, its
    param groups, and the file left unread (fp16 / bf16 wrappers' state)."""
    opt = top.get("optimizer")
    if files.optim or (opt and "state" not in opt):
        return start, [], files.optim[0] if files.optim else files.model[0]
    if not opt:
        return start, [], None
    groups = [dict(g) for g in opt["param_groups"]]
    rest = {n: module[n] for n in candidates[start:]}
    names = _guess_names(rest, (), [len(g["params"]) for g in groups], None, opt["state"],
                         files.model[0])
    _take_state(out, opt["state"], names, module, files.model[0])
    return (candidates.index(names[-1]) + 1 if names else start), groups, None


def stage0(top: Mapping, module: dict[str, torch.Tensor],
           position_names: Sequence[Sequence[str]] | None, frozen: frozenset[str],
           tag_dir: Path) -> tuple[ByName, list[dict], dict | None]:
    """A data-parallel model file's ``optimizer`` (fp32 masters of fp16 / bf16 wrappers
    too) by name, its param groups and loss scale (see the module docstring for the
    names)."""
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
    _take_state(out, state, names, module, tag_dir)
    return out, groups, ds_partitions.scaler_state(opt.get("loss_scaler"), opt)


def _take_state(out: ByName, state: Mapping, names: Sequence[str],
                module: Mapping[str, torch.Tensor], where: Path) -> None:
    """A torch optimizer's ``state`` (by position) under ``names`` (by position)."""
    for p, entry in state.items():
        name = names[int(p)]
        out.state[name] = {k: _fit(v, module, name, where) for k, v in entry.items()
                           if torch.is_tensor(v) and v.dim() > 0}
        out.scalars[name] = {k: v for k, v in entry.items()
                             if not (torch.is_tensor(v) and v.dim() > 0)}


def moe_stage0(top: Mapping, module: dict[str, torch.Tensor], found: ds_files.Files
               ) -> tuple[ByName, list[dict], Path | None]:
    """An MoE model without ZeRO: expert-parallel rank ``e``'s optimizer file holds its
    dense group (the module's parameters, as every rank's) and its MoE group (its local
    experts' parameters), by position. Their names; the file left unread where the
    layout is not that (several expert-parallel sizes, fp16 / bf16 wrappers' state).

    Raises:
        UsageError: an expert-parallel rank's optimizer file missing (naming it).
    """
    out = ByName(dict(module))
    opt = top.get("optimizer")  # expert-parallel rank 0's, as its own file
    if not opt:
        return out, [], None
    eps = {ds_parallel.expert_parallel_size(g) for g in opt.get("param_groups") or []} - {1}
    files = found.expert_optim
    if len(eps) != 1 or "state" not in opt:
        return out, [], files[0] if files else found.model[0]
    ep = min(eps)
    if len(files) != ep:
        what = f"{ds_files.expert_optim_file(len(files))} is missing" if len(files) < ep \
            else f"{len(files)} expp_rank_* optimizer files"
        raise UsageError(f"{what} (an MoE model at expert-parallel size {ep} without ZeRO "
                         "has one optimizer file per expert-parallel rank)",
                         where=str(found.tag_dir),
                         hint="copy the whole tag directory (every rank's files); files of "
                              "two saves must not be mixed")
    dense = dict(top.get("module") or {})
    buffers = top.get("buffer_names") or ()
    groups: list[dict] = []
    for e, path in enumerate(files):
        inner = ds_files.load(path)["optimizer"]
        groups = groups or [dict(g) for g in inner["param_groups"]]
        mine = {**dense, **ds_parallel.rank_experts(module, len(files), e)}
        counts = [len(g["params"]) for g in inner["param_groups"]]
        names = _guess_names(mine, buffers, counts, None, inner["state"], path)
        _take_state(out, inner["state"], names, mine, path)
    return out, groups, None


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
