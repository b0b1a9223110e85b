"""Subgroups of the data-parallel group: hpZ's node-local copies (ZeRO++) and MiCS's shard
and replica groups.

The planning is pure (:func:`blocks`, :func:`strides`); :func:`make_subgroup` creates this
rank's group (only its members take part: ``use_local_synchronization``), once per engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deepshard.errors import UsageError


@dataclass(frozen=True)
class SubGroup:
    """This rank's subgroup: the process group, its size and this rank's place in it."""

    pg: Any
    size: int
    rank: int
    ranks: tuple[int, ...]
    """Its members' global ranks, ascending (their group ranks are their positions)."""


def blocks(members: Sequence[int], size: int) -> list[tuple[int, ...]]:
    """``members`` cut into consecutive groups of ``size`` (the ranks of one node, when the
    launcher places ranks host by host)."""
    return [tuple(members[i:i + size]) for i in range(0, len(members), size)]


def strides(members: Sequence[int], size: int) -> list[tuple[int, ...]]:
    """The groups of one rank from each block of ``size``: the same place in every block."""
    return [tuple(members[i::size]) for i in range(size)]


def check_size(key: str, size: int, world: int) -> None:
    """A group size the data-parallel world can be cut into."""
    if world % size:
        raise UsageError(f"{key} {size} does not divide the data-parallel world of {world} "
                         "ranks", where=f"zero_optimization.{key}",
                         hint=f"use a divisor of {world} (the ranks per node, usually)")


def make_subgroup(pg: Any, world: int, rank: int, size: int, strided: bool = False
                  ) -> SubGroup:
    """This rank's group among the data-parallel ``pg`` (``world`` ranks, this one at
    ``rank``): consecutive blocks of ``size``, or with ``strided`` the ranks at this one's
    place in every block."""
    import torch.distributed as dist

    from deepshard.comm.teardown import keep

    members = tuple(dist.get_process_group_ranks(pg)) if pg is not None else \
        tuple(range(dist.get_world_size()))
    me = members[rank]
    sets = strides(members, size) if strided else blocks(members, size)
    mine = next(s for s in sets if me in s)
    if len(mine) == world:
        return SubGroup(pg, world, rank, members)
    group = dist.new_group(list(mine), use_local_synchronization=True)
    keep(group)  # never destructed mid-process: see comm/teardown.py
    return SubGroup(group, len(mine), mine.index(me), mine)
