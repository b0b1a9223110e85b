"""How a tensor-parallel parameter is cut into per-rank shards, and back (pure).

A :class:`ShardSpec` says along which dimension a full tensor is split and, for fused
layers, into which consecutive *sections* that dimension falls before splitting: a fused
``qkv`` weight ``[3d, d]`` has sections ``(d, d, d)``, and rank ``r`` of ``T`` holds rows
``r*d/T:(r+1)*d/T`` of *each* section (whole heads of q, k and v), stacked in section
order. Without sections, rank ``r`` holds the ``r``-th contiguous chunk.

Everything here is a pure function of tensors and specs, with no communication: the layers
use :func:`shard_tensor` to cut a dense module's weights, checkpoints use
:func:`tp_shard_state_dict` / :func:`tp_merge_state_dicts` to go between one full state
dict and ``T`` per-rank ones. A layout is a mapping ``parameter name -> ShardSpec``; a name
that is not in it is replicated (every rank holds the full tensor).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from deepshard.errors import UsageError


@dataclass(frozen=True)
class ShardSpec:
    """One parameter's split over the tensor-parallel ranks."""

    dim: int
    """Dimension of the full tensor that is split (0: output rows, 1: input columns)."""
    sections: tuple[int, ...] = ()
    """Sizes of consecutive fused sections along ``dim``, each split on its own; empty: the
    whole dimension is one section."""

    def section_sizes(self, full: int) -> tuple[int, ...]:
        """The sections of a dimension of size ``full`` (the whole of it when unfused)."""
        if not self.sections:
            return (full,)
        assert sum(self.sections) == full, (self.sections, full)
        return self.sections

    def local_size(self, full: int, world: int) -> int:
        """Size of one rank's shard along :attr:`dim`."""
        return sum(size // world for size in self.section_sizes(full))


def check_divisible(what: str, full: int, spec: ShardSpec, world: int) -> None:
    """Raise a :class:`UsageError` unless every section of ``full`` splits evenly."""
    for size in spec.section_sizes(full):
        if size % world:
            parts = f" (sections {list(spec.sections)})" if spec.sections else ""
            raise UsageError(
                f"cannot split {full}{parts} along dim {spec.dim} evenly over {world} "
                f"tensor-parallel ranks", where=what,
                hint=f"choose a tensor-parallel size that divides {size}, or keep {what} "
                     "replicated")


def shard_tensor(full: torch.Tensor, spec: ShardSpec, rank: int, world: int,
                 what: str = "tensor") -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (a new contiguous tensor, never a view)."""
    check_divisible(what, full.shape[spec.dim], spec, world)
    pieces = []
    for section in full.split(list(spec.section_sizes(full.shape[spec.dim])), dim=spec.dim):
        pieces.append(section.chunk(world, dim=spec.dim)[rank])
    return torch.cat(pieces, dim=spec.dim).contiguous()


def merge_shards(shards: Sequence[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: the full tensor from every rank's shard, in rank
    order."""
    world = len(shards)
    full = shards[0].shape[spec.dim] * world
    local = [size // world for size in spec.section_sizes(full)]
    per_rank = [shard.split(local, dim=spec.dim) for shard in shards]
    sections = [torch.cat([parts[i] for parts in per_rank], dim=spec.dim)
                for i in range(len(local))]
    return torch.cat(sections, dim=spec.dim)


def tp_shard_state_dict(full: Mapping[str, torch.Tensor], layout: Mapping[str, ShardSpec],
                        rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state dict from a full (dense) one: sharded names are cut, the
    others kept as they are (shared, not copied)."""
    missing = sorted(set(layout) - set(full))
    if missing:
        raise UsageError(f"the state dict has no entry for sharded parameter(s) {missing}",
                         where="tp_shard_state_dict",
                         hint="pass the dense model's state_dict() with the same names")
    return {name: shard_tensor(value, layout[name], rank, world, name)
            if name in layout else value for name, value in full.items()}


def tp_merge_state_dicts(shards: Sequence[Mapping[str, torch.Tensor]],
                         layout: Mapping[str, ShardSpec]) -> dict[str, torch.Tensor]:
    """The full state dict from every tensor-parallel rank's, in rank order. Replicated
    entries are taken from rank 0 (they are equal on every rank)."""
    if not shards:
        raise UsageError("no shards to merge", where="tp_merge_state_dicts",
                         hint="pass one state dict per tensor-parallel rank, in rank order")
    names = list(shards[0])
    for rank, sd in enumerate(shards[1:], start=1):
        if set(sd) != set(names):
            raise UsageError(f"rank {rank}'s state dict has other keys than rank 0's",
                             where="tp_merge_state_dicts",
                             hint="merge the state dicts of one tensor-parallel group")
    return {name: merge_shards([sd[name] for sd in shards], layout[name])
            if name in layout else shards[0][name] for name in names}
