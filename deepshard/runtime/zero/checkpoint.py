"""ZeRO checkpoints: per-rank shards, and any checkpoint read back *by parameter name*.

Saving, every rank writes its shard of every flat group into its own rank file: the
group's member names, offsets and element counts, the shard bounds, the fp32 values
(master or parameter) and the optimizer state tensors of the shard. Rank 0's shared file
keeps the rest (buffers and frozen parameters, optimizer hyperparameters, scheduler, ...).

Loading goes through one neutral form, :class:`ByName`: full fp32 values and full
optimizer state per parameter name, assembled from the shards of however many ranks wrote
them (or from a stage 0 checkpoint). From it, any stage at any world size takes what it
needs, so a checkpoint loads at another world size or stage with no conversion step.
A ZeRO rank assembles only what it keeps (:func:`needed`): optimizer state for the
parameters its shards cut into, values for those too at stage 3 (at stages 1-2 every
rank holds every value). Shard files are memory-mapped, so only those parts are read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import checkpoint as ckpt
from .partition import pieces
from .runtime import ZeroRuntime


@dataclass
class ByName:
    """A checkpoint's model and optimizer state keyed by parameter name, in fp32 where the
    job kept fp32 (masters)."""

    values: dict[str, torch.Tensor]
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    scalars: dict[str, dict[str, object]] = field(default_factory=dict)
    # every parameter name the checkpoint holds (``values`` may keep only the needed ones)
    present: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Needed:
    """Which names one rank takes from a checkpoint: values and optimizer state."""

    values: frozenset[str]
    state: frozenset[str]


def needed(zero: ZeroRuntime) -> Needed:
    """What this rank's flat groups keep: state for the parameters its shards cut into;
    values for those in partitioned groups, for every member of a replicated group."""
    values: set[str] = set()
    state: set[str] = set()
    for g in zero.groups:
        mine = {g.names[g.flat.params.index(pc.param)] for pc in pieces(g.flat, g.spec, g.rank)}
        state |= mine
        values |= mine if g.partitioned else set(g.names)
    return Needed(frozenset(values), frozenset(state))


def shard_payload(zero: ZeroRuntime, optimizer) -> list[dict]:
    """This rank's part of a checkpoint: one entry per flat group."""
    out = []
    for k, g in enumerate(zero.groups):
        t = zero.stepper.step_tensors[k]
        state = optimizer.state.get(t, {}) if optimizer is not None else {}
        out.append({
            "names": g.names, "offsets": g.flat.offsets, "numels": g.flat.numels,
            "shapes": [tuple(s) for s in g.shapes], "lo": g.lo, "hi": g.hi,
            "values": t.detach().float().clone(),
            "state": {n: v.clone() for n, v in state.items()
                      if torch.is_tensor(v) and v.dim() > 0},
            "scalars": {n: v for n, v in state.items()
                        if not (torch.is_tensor(v) and v.dim() > 0)},
        })
    return out


def owned_names(zero: ZeroRuntime, module: torch.nn.Module) -> set[str]:
    """Every state-dict name (aliases included) of a parameter the flat groups own."""
    ids = {id(p) for g in zero.groups for p in g.params}
    return {n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in ids}


def aliases(module: torch.nn.Module) -> dict[str, str]:
    """``alias → canonical name`` for parameters registered under several names."""
    first: dict[int, str] = {}
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def read_by_name(tag_dir: Path, manifest: ckpt.Manifest, shared: Mapping,
                 ranks: Sequence[int] | None = None, need: Needed | None = None) -> ByName:
    """The neutral form of any complete checkpoint (see the module docstring). ``ranks``:
    whose shard files hold this model's shards (default: all; with model parallelism the
    data-parallel ranks of one (pipe, tensor) coordinate, ``shared`` being that
    coordinate's own module state). ``need``: assemble only these names' sharded values
    and state (default: everything, as consolidation wants)."""
    if manifest.zero_stage == 0:
        return _stage0(shared)
    out = ByName({n: v for n, v in shared["module"].items()})
    for r in (range(manifest.world_size) if ranks is None else ranks):
        for entry in ckpt.load_file(tag_dir, ckpt.rank_file(r), mmap=True)["zero"]:
            _scatter(entry, out, need)
    out.present.update(out.values)
    for alias, canonical in shared.get("aliases", {}).items():
        if canonical in out.present:
            out.present.add(alias)
            if canonical in out.values:
                out.values[alias] = out.values[canonical]
    return out


def _scatter(entry: Mapping, out: ByName, need: Needed | None) -> None:
    lo, hi = entry["lo"], entry["hi"]
    for name, off, n, shape in zip(entry["names"], entry["offsets"], entry["numels"],
                                   entry["shapes"], strict=True):
        out.present.add(name)
        start, end = max(off, lo), min(off + n, hi)
        if need is None or name in need.values:
            values = out.values
            if name not in values or values[name].shape != torch.Size(shape):
                values[name] = torch.zeros(shape, dtype=torch.float32)
            if start < end:
                values[name].view(-1)[start - off:end - off] = \
                    entry["values"][start - lo:end - lo]
        if need is not None and name not in need.state:
            continue
        for key, shard in entry["state"].items():
            full = out.state.setdefault(name, {}).setdefault(
                key, torch.zeros(shape, dtype=shard.dtype))
            if start < end:
                full.view(-1)[start - off:end - off] = shard[start - lo:end - lo]
        out.scalars.setdefault(name, _own(entry["scalars"]))


def _stage0(shared: Mapping) -> ByName:
    values = ckpt.full_precision(shared)
    opt = shared.get("optimizer") or {}
    names = shared.get("optimizer_names") or []
    state, scalars = {}, {}
    for pos, entry in (opt.get("state") or {}).items():
        if pos < len(names):
            state[names[pos]] = {k: v for k, v in entry.items()
                                 if torch.is_tensor(v) and v.dim() > 0}
            scalars[names[pos]] = {k: v for k, v in entry.items()
                                   if not (torch.is_tensor(v) and v.dim() > 0)}
    return ByName(values, state, scalars, set(values))


@torch.no_grad()
def load_into_zero(zero: ZeroRuntime, optimizer, by_name: ByName,
                   load_optimizer: bool) -> list[str]:
    """Fill this rank's shards (values, masters and, if asked, optimizer state) from
    ``by_name``. Returns the names it lacked (left as they were)."""
    missing = []
    for k, g in enumerate(zero.groups):
        t = zero.stepper.step_tensors[k]
        fresh = torch.zeros(g.spec.shard, dtype=torch.float32)
        state: dict[str, torch.Tensor] = {}
        found = [n in by_name.present for n in g.names]
        missing.extend(n for n, ok in zip(g.names, found, strict=True) if not ok)
        fresh.copy_(g.read_shard())
        for piece in pieces(g.flat, g.spec, g.rank):
            name = g.names[g.flat.params.index(piece.param)]
            src = slice(piece.param_start, piece.param_start + piece.length)
            dst = slice(piece.shard_start, piece.shard_start + piece.length)
            if name in by_name.values:
                fresh[dst] = by_name.values[name].reshape(-1)[src].float()
            for key, full in by_name.state.get(name, {}).items():
                buf = state.setdefault(key, torch.zeros(g.spec.shard, dtype=full.dtype))
                buf[dst] = full.reshape(-1)[src]
        g.write_shard(fresh)
        if t is not g.shard and t.numel():
            t.copy_(fresh)
        if not g.partitioned:
            for name, p in zip(g.names, g.params, strict=True):
                if name in by_name.values:
                    p.copy_(by_name.values[name].view_as(p))
        if load_optimizer and optimizer is not None and state:
            scal = next((by_name.scalars[n] for n in g.names if n in by_name.scalars), {})
            # a fresh step counter per group: fused optimizers increment it in place
            optimizer.state[t] = {**_own(scal), **state}
    return missing


def stage0_optimizer_state(by_name: ByName, names_in_order: list[str],
                           param_groups: list[dict]) -> dict:
    """An ``optimizer.state_dict()`` for a stage 0 engine whose optimizer steps the
    parameters ``names_in_order`` (positions), from any checkpoint's :class:`ByName`."""
    state = {}
    for pos, name in enumerate(names_in_order):
        if name in by_name.state:
            state[pos] = {**_own(by_name.scalars.get(name, {})), **by_name.state[name]}
    return {"state": state, "param_groups": param_groups}


def _own(scalars: Mapping[str, object]) -> dict[str, object]:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}
