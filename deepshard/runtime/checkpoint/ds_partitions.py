"""DeepSpeed's ZeRO 1-3 optimizer partitions (``*_optim_states.pt``) read back by parameter
name: fp32 masters and optimizer state, whole per parameter, assembled from every rank's
partition.

At stages 1-2 each group's parameters lie end to end (in ``param_shapes`` order) across the
ranks' partitions one after the other (an MoE group's across each expert-parallel rank's
expert data-parallel ranks, :mod:`.ds_parallel`); at stage 3 every parameter is cut into
``ceil(numel / world)`` pieces, rank ``r`` holding piece ``r`` of each, in order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import ds_files, ds_parallel
from deepshard.runtime.checkpoint.by_name import ByName, Needed


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


def param_groups(opt: Mapping) -> list[dict]:
    """The optimizer's param groups (hyperparameters) in one rank's optimizer file."""
    base = opt.get("base_optimizer_state", opt.get("optimizer_state_dict"))
    if isinstance(base, Mapping):
        return [dict(g) for g in base.get("param_groups", [])]
    return []


def stage12(optims: Sequence[Mapping], shapes: Sequence[Mapping[str, Sequence[int]]],
            found: ds_files.Files, need: Needed | None,
            groups: Sequence[Mapping[str, Any]] = ()) -> ByName:
    """Stages 1-2: each group's names from the partitions of every rank, an MoE group's
    (:mod:`.ds_parallel`) from those of each expert-parallel rank's expert data-parallel
    ranks, under global expert names."""
    out = ByName({})
    for g, group in enumerate(shapes):
        ep = ds_parallel.expert_parallel_size(groups[g]) if g < len(groups) else 1
        for e in range(ep):
            ranks = [optims[r] for r in ds_parallel.partition_ranks(ep, e, len(optims))]
            names = group if ep == 1 else ds_parallel.global_names(group, e)
            _group12(out, ranks, g, names, found, need)
    return out


def _group12(out: ByName, optims: Sequence[Mapping], g: int,
             group: Mapping[str, Sequence[int]], found: ds_files.Files,
             need: Needed | None) -> None:
    flats = [o["single_partition_of_fp32_groups"][g].detach() for o in optims]
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


def stage3(optims: Sequence[Mapping], shapes: Sequence[Mapping[str, Sequence[int]]],
           world: int, found: ds_files.Files, need: Needed | None) -> ByName:
    """Stage 3: every parameter's ``ceil(numel / world)`` pieces, one per rank, joined;
    frozen parameters from the model files' ``frozen_param_fragments``."""
    out = ByName({})
    for g, group in enumerate(shapes):
        flats = [o["fp32_flat_groups"][g].detach() for o in optims]
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
            # a rank that asks for certain names (``need``) copies only its shards'
            # slices of them: they stay pieces (:class:`Pieces`) until read
            join = _joined if need is None else Pieces
            if need is None or name in need.values:
                out.values[name] = join([f[off:off + part] for f in flats], n, shape)
            if tensors and (need is None or name in need.state):
                out.state[name] = {k: join([r[off:off + part] for r in ranks], n, shape)
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


class Pieces:
    """A stage 3 parameter's value or state tensor as its ranks' pieces (views of the
    memory-mapped files), joined only where read: ``t.reshape(-1)[a:b]`` copies just the
    pieces ``[a, b)`` spans (what a ZeRO shard takes of a parameter), and anything else
    asked of it (``view_as``, ``float``...) is asked of the whole tensor, joined once.
    A ZeRO-3 load so copies a rank's share of the checkpoint, not every parameter its
    shards cut into, whole. Typed as a tensor where :class:`ByName` holds it."""

    def __init__(self, pieces: Sequence[torch.Tensor], numel: int, shape: Sequence[int]):
        self._pieces = [p.reshape(-1) for p in pieces]
        self._numel = numel
        self._shape = tuple(shape)
        self._whole: torch.Tensor | None = None
        self.dtype = self._pieces[0].dtype
        self.shape = torch.Size(self._shape)

    def numel(self) -> int:
        return self._numel

    def reshape(self, *shape: int) -> Any:
        """``reshape(-1)``: itself, sliced by element range; else the whole tensor's."""
        if shape in ((-1,), ((-1,),)):
            return _FlatPieces(self)
        return self.whole().reshape(*shape)

    def span(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor, from the pieces they lie in."""
        out, base = [], 0
        for piece in self._pieces:
            a, b = max(lo, base), min(hi, base + piece.numel(), self._numel)
            if a < b:
                out.append(piece[a - base:b - base])
            base += piece.numel()
        if not out:
            return torch.empty(0, dtype=self.dtype)
        return out[0] if len(out) == 1 else torch.cat(out)

    def whole(self) -> torch.Tensor:
        if self._whole is None:
            self._whole = _joined(self._pieces, self._numel, self._shape)
        return self._whole

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not a tensor's: copy/pickle probing a bare instance
            raise AttributeError(name)
        return getattr(self.whole(), name)


class _FlatPieces:
    def __init__(self, pieces: Pieces) -> None:
        self._of = pieces

    def __getitem__(self, where: slice) -> torch.Tensor:
        lo, hi, step = where.indices(self._of.numel())
        if step != 1:
            return self._of.whole().reshape(-1)[where]
        return self._of.span(lo, hi)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._of.whole().reshape(-1), name)


def scaler_state(scaler: Any, holder: Mapping) -> dict | None:
    """DeepSpeed's loss scaler state (its object's attributes, or stage 0's keys) in
    deepshard's loss scaler ``state_dict`` form."""
    source = vars(scaler) if scaler is not None and not isinstance(scaler, Mapping) \
        else holder
    keys = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
    state = {k: source[k] for k in keys if k in source}
    return state if "cur_scale" in state else None
