"""Any checkpoint read back *by parameter name*: the neutral form every load goes through.

:class:`ByName` holds full fp32 values and full optimizer state per parameter name,
assembled from the shards of however many ranks wrote them (a ZeRO checkpoint, see
:mod:`.zero_shards`) or from a stage 0 checkpoint's shared file. From it, any strategy at
any world size takes what it needs, so a checkpoint loads at another world size or stage
with no conversion step. A rank can ask for only what it keeps (:class:`Needed`); shard
files are memory-mapped, so only those parts are read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepshard.runtime.checkpoint import format as fmt


@dataclass
class ByName:
    """A checkpoint's model and optimizer state keyed by parameter name, in fp32 where the
    job kept fp32 (masters)."""

    values: dict[str, torch.Tensor]
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    scalars: dict[str, dict[str, object]] = field(default_factory=dict)
    # every parameter name the checkpoint holds (``values`` may keep only the needed ones)
    present: set[str] = field(default_factory=set)
    # hands back the pages of the memory-mapped files read so far (:mod:`.mapped`)
    release: Callable[[], None] | None = None


@dataclass(frozen=True)
class Needed:
    """Which names one rank takes from a checkpoint: values and optimizer state."""

    values: frozenset[str]
    state: frozenset[str]


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


def read_by_name(tag_dir: Path, manifest: fmt.Manifest, shared: Mapping,
                 ranks: Sequence[int] | None = None, need: Needed | None = None) -> ByName:
    """The neutral form of any complete checkpoint (see the module docstring). ``ranks``:
    whose shard files hold this model's shards (default: all; with model parallelism the
    data-parallel ranks of one (pipe, tensor) coordinate, ``shared`` being that
    coordinate's own module state). ``need``: assemble only these names' sharded values
    and state (default: everything, as consolidation wants)."""
    stage0 = manifest.zero_stage == 0
    out = _stage0(shared) if stage0 else ByName({n: v for n, v in shared["module"].items()})
    for r in (range(manifest.world_size) if ranks is None else ranks):
        # stage 0: entries only where a strategy keeps some (MoE experts, by global name)
        for entry in fmt.load_file(tag_dir, fmt.rank_file(r), mmap=True).get("zero", ()):
            _scatter(entry, out, need)
    if stage0:
        return out
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
        # a parameter wholly in this entry is a view of it (memory-mapped: nothing is
        # allocated or read until used); one split over ranks is assembled
        whole = start == off and end == off + n
        if need is None or name in need.values:
            values = out.values
            if whole:
                values[name] = entry["values"][start - lo:end - lo].view(shape)
            else:
                if name not in values or values[name].shape != torch.Size(shape):
                    # every element arrives from some rank's entry (a complete checkpoint)
                    values[name] = torch.empty(shape, dtype=torch.float32)
                if start < end:
                    values[name].view(-1)[start - off:end - off] = \
                        entry["values"][start - lo:end - lo]
        if need is not None and name not in need.state:
            continue
        held = out.state.setdefault(name, {}) if entry["state"] else {}
        for key, shard in entry["state"].items():
            if whole:
                held[key] = shard[start - lo:end - lo].view(shape)
                continue
            if key not in held:
                held[key] = torch.empty(shape, dtype=shard.dtype)
            full = held[key]
            if start < end:
                full.view(-1)[start - off:end - off] = shard[start - lo:end - lo]
        out.scalars.setdefault(name, copy_scalars(entry["scalars"]))


def _stage0(shared: Mapping) -> ByName:
    values = fmt.full_precision(shared)
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


def merge_groups(ours: Sequence[Mapping], saved: Sequence[Mapping]) -> list[dict]:
    """Our param groups with the checkpoint's hyperparameters (when the counts match)."""
    if len(ours) != len(saved):
        return [dict(g) for g in ours]
    return [{**s, "params": g["params"]} for g, s in zip(ours, saved, strict=True)]


def copy_scalars(scalars: Mapping[str, Any]) -> dict[str, Any]:
    """Per-parameter optimizer scalars (step counters) as fresh objects: fused optimizers
    increment them in place."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}


def stage0_optimizer_state(by_name: ByName, names_in_order: list[str],
                           param_groups: list[dict]) -> dict:
    """An ``optimizer.state_dict()`` for an optimizer stepping the whole parameters
    ``names_in_order`` (positions), from any checkpoint's :class:`ByName`."""
    state = {}
    for pos, name in enumerate(names_in_order):
        if name in by_name.state:
            state[pos] = {**copy_scalars(by_name.scalars.get(name, {})), **by_name.state[name]}
    return {"state": state, "param_groups": param_groups}


def in_order(values: Mapping[str, torch.Tensor], order: Sequence[str]) -> dict:
    """``values`` in the order of ``order`` (the module's state-dict names), any others
    after them as they came."""
    first = {n: values[n] for n in order if n in values}
    return {**first, **{n: v for n, v in values.items() if n not in first}}
