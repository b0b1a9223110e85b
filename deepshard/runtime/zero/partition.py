"""Shard math shared by every ZeRO stage: flat buffers, padding and rank ranges (pure).

A *flat group* lays some parameters of one dtype (and one optimizer param group) end to
end in one buffer, padded to a multiple of the data-parallel world size ``W``. Rank ``r``
owns the ``r``-th of ``W`` equal slices (its *shard*): its optimizer state, its master
weights, its reduced gradients (stages 2-3) and, at stage 3, its parameters. Because every
group is sliced the same way, a reduce-scatter of a group's gradients lands exactly on the
shards and an all-gather of the shards rebuilds the group.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardSpec:
    """How a flat buffer of ``numel`` elements splits over ``world`` ranks."""

    numel: int
    world: int

    @property
    def shard(self) -> int:
        """Elements per rank (padding included)."""
        return -(-self.numel // self.world) if self.numel else 0

    @property
    def padded(self) -> int:
        """Length of the padded flat buffer: ``shard × world``."""
        return self.shard * self.world

    def bounds(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the padded buffer."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a world of {self.world}")
        return rank * self.shard, (rank + 1) * self.shard


@dataclass(frozen=True)
class FlatLayout:
    """Members of one flat group: indices into the engine's parameter list, their offsets
    in the flat buffer and their element counts."""

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of real data (no padding)."""
        return self.offsets[-1] + self.numels[-1] if self.params else 0


@dataclass(frozen=True)
class Piece:
    """Part of one parameter inside one rank's shard: ``length`` elements starting at
    ``param_start`` in the flattened parameter and at ``shard_start`` in the shard."""

    param: int
    param_start: int
    shard_start: int
    length: int


def layout(indices: Sequence[int], numels: Sequence[int]) -> FlatLayout:
    """The flat layout of the parameters ``indices`` (element counts ``numels``), in order."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    return FlatLayout(tuple(indices), tuple(offsets), tuple(numels))


def pieces(flat: FlatLayout, spec: ShardSpec, rank: int) -> tuple[Piece, ...]:
    """The parts of ``flat``'s parameters that fall into ``rank``'s shard."""
    lo, hi = spec.bounds(rank)
    found = []
    for i, off, n in zip(flat.params, flat.offsets, flat.numels, strict=True):
        start, end = max(off, lo), min(off + n, hi)
        if start < end:
            found.append(Piece(i, start - off, start - lo, end - start))
    return tuple(found)


def split_by_size(numels: Sequence[int], cap: int) -> list[list[int]]:
    """Consecutive positions of ``numels`` grouped so that a group holds at most ``cap``
    elements (a bigger element gets a group of its own)."""
    if cap < 1:
        raise ValueError(f"group capacity must be positive, got {cap}")
    groups: list[list[int]] = []
    filled = 0
    for pos, n in enumerate(numels):
        if groups and filled + n <= cap:
            groups[-1].append(pos)
            filled += n
        else:
            groups.append([pos])
            filled = n
    return groups


@dataclass(frozen=True)
class GroupPlan:
    """One flat group to build: parameter indices (in flat order), whether it is
    partitioned (stage 3) and the stage 3 unit that owns it (``None``: replicated)."""

    params: tuple[int, ...]
    opt_group: int
    partitioned: bool
    unit: int | None


def plan_groups(numels: Sequence[int], dtypes: Sequence[object],
                opt_groups: Sequence[Sequence[int]], cap: int,
                units: Sequence[Sequence[int]] = (),
                persistence_threshold: int = 0) -> tuple[GroupPlan, ...]:
    """Flat groups over the parameters (indices into ``numels``): never mixing dtypes or
    optimizer param groups.

    Without ``units`` (stages 1-2) parameters go in backward order (reverse registration),
    at most ``cap`` elements per group, so that the first group fills first in backward.
    With ``units`` (stage 3, lists of parameter indices per unit, in forward order; the
    first is the root) each unit's parameters of at least ``persistence_threshold``
    elements form partitioned groups of that unit, last unit first (backward reaches it
    first); the smaller ones form replicated groups as at stages 1-2, after them. The
    root's parameters registered between other units' form groups of their own at that
    place (a head registered after the layers reduces first, the embedding last), so that
    the root's gradients do not all wait for the end of backward.

    The order of the result is the order gradients are reduced in, the same on every rank.
    """
    group_of = {i: k for k, members in enumerate(opt_groups) for i in members}
    plans: list[GroupPlan] = []
    small: list[int] = []
    for u, members in reversed(_segments(units)):
        big = [i for i in members if i in group_of and numels[i] >= persistence_threshold]
        small.extend(i for i in members if i in group_of and numels[i] < persistence_threshold)
        for key in _keys(big, dtypes, group_of):
            chosen = tuple(i for i in big if (dtypes[i], group_of[i]) == key)
            plans.append(GroupPlan(chosen, key[1], True, u))
    rest = sorted(small) if units else sorted(group_of)
    backward = list(reversed(rest))
    for key in _keys(backward, dtypes, group_of):
        keyed = [i for i in backward if (dtypes[i], group_of[i]) == key]
        for part in split_by_size([numels[i] for i in keyed], cap):
            plans.append(GroupPlan(tuple(keyed[p] for p in part), key[1], False, None))
    return tuple(plans)


def _segments(units: Sequence[Sequence[int]]) -> list[tuple[int, list[int]]]:
    """``(unit, members)`` in registration order: every unit but the root whole, at its
    first parameter; the root cut into runs of parameters with no other unit's between."""
    if not units:
        return []
    segments = [(min(members), u, sorted(members))
                for u, members in enumerate(units) if u and members]
    others = sorted(i for members in units[1:] for i in members)
    runs: list[list[int]] = []
    for i in sorted(units[0]):
        if runs and bisect.bisect(others, runs[-1][-1]) == bisect.bisect(others, i):
            runs[-1].append(i)
        else:
            runs.append([i])
    segments.extend((run[0], 0, run) for run in runs)
    return [(u, members) for _, u, members in sorted(segments)]


def _keys(indices: Sequence[int], dtypes: Sequence[object],
          group_of: dict[int, int]) -> list[tuple[object, int]]:
    keys: list[tuple[object, int]] = []
    for i in indices:
        key = (dtypes[i], group_of[i])
        if key not in keys:
            keys.append(key)
    return keys
