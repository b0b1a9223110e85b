"""Where DeepSpeed 0.19.8 keeps each parameter in its ZeRO partitions (pure), for writing
its layout.

Stages 1-2: each optimizer param group's trainable parameters lie end to end in one flat
buffer (``zero_optimization.parameter_alignment`` pads each but the last to 16 bytes),
padded at the end to a multiple of ``2 × world``; rank ``r`` keeps the ``r``-th of
``world`` equal partitions. Stage 3: each group is cut into sub-groups of about
``sub_group_size`` partitioned elements; every parameter is cut into ``ceil(numel /
world)`` pieces and rank ``r``'s flat sub-group holds piece ``r`` of each, in order, the
last piece zero-padded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

NCCL_START_ALIGNMENT = 2
"""DeepSpeed's ``nccl_start_alignment_factor``: a group pads to ``2 × world``."""
SUB_GROUP_SIZE = 1_000_000_000
"""``zero_optimization.sub_group_size``'s default."""


@dataclass(frozen=True)
class Partitioned:
    """One flat group of DeepSpeed's ZeRO, seen from one rank: its members, where each
    starts in the group (stages 1-2) or in this rank's flat (stage 3), and this rank's
    partition."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    paddings: tuple[int, ...]  # stages 1-2: after each member (parameter_alignment)
    start: int  # stages 1-2: this rank's partition in the group; stage 3: 0
    size: int  # this rank's partition, padding included
    padding: int  # stages 1-2: of it, the group's end padding on this rank
    group: int  # the optimizer param group it belongs to


def stage12(names: Sequence[str], numels: Sequence[int], world: int, rank: int,
            group: int, element_size: int = 4, parameter_alignment: bool = False
            ) -> Partitioned:
    """Rank ``rank``'s partition of one stage 1-2 group (DeepSpeed's
    ``DeepSpeedZeroOptimizer.__init__``)."""
    align = 16 // math.gcd(16, element_size) if parameter_alignment else 1
    offsets, paddings, at = [], [], 0
    for k, n in enumerate(numels):
        offsets.append(at)
        at += n
        pad = 0 if k == len(numels) - 1 else (-at) % align
        paddings.append(pad)
        at += pad
    padded = at
    alignment = NCCL_START_ALIGNMENT * world
    aligned = math.ceil(padded / alignment) * alignment
    size = aligned // world
    start = rank * size
    if padded <= start:
        end_padding = size
    elif padded < start + size:
        end_padding = start + size - padded
    else:
        end_padding = 0
    return Partitioned(tuple(names), tuple(numels), tuple(offsets), tuple(paddings),
                       start, size, end_padding, group)


def piece(numel: int, world: int) -> int:
    """Stage 3: the elements of one parameter each rank keeps (padding included)."""
    return math.ceil(numel / world)


def stage3(names: Sequence[str], numels: Sequence[int], world: int, group: int,
           sub_group_size: int = SUB_GROUP_SIZE) -> list[Partitioned]:
    """One stage 3 param group's sub-groups as every rank lays them out (DeepSpeed's
    ``_create_fp16_sub_groups``)."""
    total = sum(piece(n, world) for n in numels)
    cuts: list[list[int]] = []
    if sub_group_size >= total:
        cuts.append(list(range(len(names))))
    else:
        current: list[int] = []
        size = 0
        for k, n in enumerate(numels):
            current.append(k)
            size += piece(n, world)
            if size >= sub_group_size or k == len(numels) - 1:
                cuts.append(current)
                current, size = [], 0
    out = []
    for members in cuts:
        offsets, at = [], 0
        for k in members:
            offsets.append(at)
            at += piece(numels[k], world)
        out.append(Partitioned(tuple(names[k] for k in members),
                               tuple(numels[k] for k in members), tuple(offsets),
                               (0,) * len(members), 0, at, 0, group))
    return out
