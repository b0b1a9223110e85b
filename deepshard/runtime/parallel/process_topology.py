"""DeepSpeed's ``ProcessTopology``: ranks laid out on a grid of named axes, row-major.

``ProcessTopology(axes=["pipe", "data"], dims=[2, 3])`` numbers its 6 ranks with the last
axis varying fastest (``(pipe, data)`` = ``(0, 0), (0, 1), (0, 2), (1, 0), ...``), and
answers DeepSpeed's questions about that grid: a rank's coordinates, the rank at some
coordinates, the ranks along one axis (the members of each communicator of that axis) and
the ranks matching a partial coordinate. Pure arithmetic, no torch and no process groups:
:class:`~deepshard.runtime.parallel.topology.Topology` (deepshard's fixed ``pipe x data x
sequence x tensor`` grid) answers the same questions through this class, and
:func:`~deepshard.runtime.parallel.topology.PipelineParallelGrid` makes the groups.
"""

from __future__ import annotations

import itertools
import math
from collections import namedtuple
from collections.abc import Iterable, Sequence
from typing import Any

from deepshard.errors import UsageValueError

DEFAULT_OMITTED = ("data", "pipe")
"""Axes :meth:`ProcessTopology.get_rank_repr` leaves out unless told otherwise (DeepSpeed's
default: checkpoint file names carry the model-parallel coordinates only)."""


def coord_type(axes: Sequence[str]) -> type:
    """DeepSpeed's ``ProcessCoord``: a named tuple over ``axes``."""
    return namedtuple("ProcessCoord", list(axes))


class ProcessTopology:
    """A row-major grid of ranks over named ``axes`` of lengths ``dims`` (DeepSpeed's
    ``deepspeed.runtime.pipe.topology.ProcessTopology``; see the module docstring).

    Raises:
        UsageValueError: ``axes`` and ``dims`` differ in length, an axis name repeats or is
            not an identifier, or a length is not a positive int.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]):
        axes, dims = tuple(axes), tuple(dims)
        _check_grid(axes, dims)
        self._shape = (axes, dims)
        self._coord = coord_type(axes)

    # what a subclass with another storage of its shape overrides ------------------------

    def _grid(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """``(axes, dims)``, slowest-varying axis first."""
        return self._shape

    def _coord_type(self) -> type:
        """The named tuple :meth:`get_coord` returns."""
        return self._coord

    # DeepSpeed's interface ------------------------------------------------------------

    @property
    def axes(self) -> list[str]:
        """The axis names, slowest-varying first."""
        return list(self._grid()[0])

    @property
    def dims(self) -> list[int]:
        """The length of each axis."""
        return list(self._grid()[1])

    @property
    def ProcessCoord(self) -> type:
        """The coordinates' named tuple type."""
        return self._coord_type()

    @property
    def mapping(self) -> dict[Any, int]:
        """Every coordinate and its rank (DeepSpeed's attribute)."""
        return {self.get_coord(rank): rank for rank in range(self.world_size())}

    def world_size(self) -> int:
        """Number of ranks in the grid."""
        return math.prod(self._grid()[1])

    def get_axis_names(self) -> list[str]:
        """The axis names, in layout order."""
        return self.axes

    def get_dim(self, axis: str) -> int:
        """The length of ``axis``; 0 for an axis the grid does not have (as DeepSpeed)."""
        axes, dims = self._grid()
        return dims[axes.index(axis)] if axis in axes else 0

    def get_rank(self, **coord: int) -> int:
        """The rank at ``coord``, which names every axis (``get_rank(pipe=1, data=2)``).

        Raises:
            UsageValueError: an axis is missing or unknown (use :meth:`filter_match` for a
                slice), or a coordinate is outside its axis.
        """
        axes, dims = self._grid()
        if set(coord) != set(axes):
            raise UsageValueError(
                f"get_rank() needs one coordinate per axis, got {sorted(coord)}",
                where="ProcessTopology.get_rank", hint=f"name each of {list(axes)}; "
                "filter_match() selects the ranks of a partial coordinate")
        rank = 0
        for axis, dim in zip(axes, dims, strict=True):
            rank = rank * dim + _index(axis, coord[axis], dim)
        return rank

    def get_coord(self, rank: int) -> Any:
        """The coordinates of ``rank`` (a ``ProcessCoord``: ``.pipe``, ``.data``, ...).

        Raises:
            UsageValueError: ``rank`` is not in the grid.
        """
        world = self.world_size()
        if not isinstance(rank, int) or not 0 <= rank < world:
            raise UsageValueError(f"rank {rank!r} is not in the topology",
                                  where="ProcessTopology.get_coord",
                                  hint=f"ranks are 0..{world - 1}")
        values = []
        for dim in reversed(self._grid()[1]):
            rank, value = divmod(rank, dim)
            values.append(value)
        return self._coord_type()(*reversed(values))

    def get_rank_repr(self, rank: int, omit_axes: Iterable[str] = DEFAULT_OMITTED,
                      inner_sep: str = "_", outer_sep: str = "-") -> str:
        """``rank``'s coordinates as text, ``omit_axes`` left out: ``"model_01"`` for a
        ``pipe x data x model`` grid (``""`` when nothing is left)."""
        omitted = frozenset(omit_axes)
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}"
                              for axis in self.axes if axis not in omitted)

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The ranks of each communicator along ``axis``: one list per combination of the
        other axes' coordinates (in their row-major order), each in ``axis`` order; ``[]``
        for an axis the grid does not have (as DeepSpeed)."""
        axes, dims = self._grid()
        if axis not in axes:
            return []
        others = [(a, d) for a, d in zip(axes, dims, strict=True) if a != axis]
        lists = []
        for fixed in itertools.product(*(range(d) for _, d in others)):
            coord = dict(zip((a for a, _ in others), fixed, strict=True))
            lists.append([self.get_rank(**coord, **{axis: i})
                          for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates equal every given one, in rank order
        (``filter_match(pipe=0)``).

        Raises:
            UsageValueError: an axis the grid does not have.
        """
        unknown = set(filter_kwargs) - set(self.axes)
        if unknown:
            raise UsageValueError(f"no axis {sorted(unknown)[0]!r} in the topology",
                                  where="ProcessTopology.filter_match",
                                  hint=f"the axes are {self.axes}")
        return [rank for rank in range(self.world_size())
                if all(getattr(self.get_coord(rank), axis) == value
                       for axis, value in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose ``axis`` coordinate is ``idx``, in rank order."""
        return self.filter_match(**{axis: idx})

    def __str__(self) -> str:
        return str(self.mapping)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axes={self.axes}, dims={self.dims})"


def _check_grid(axes: tuple[str, ...], dims: tuple[int, ...]) -> None:
    where = "ProcessTopology(axes, dims)"
    if len(axes) != len(dims):
        raise UsageValueError(f"{len(axes)} axes but {len(dims)} dims", where=where,
                              hint="give one length per axis")
    if len(set(axes)) != len(axes) or not all(isinstance(a, str) and a.isidentifier()
                                              for a in axes):
        raise UsageValueError(f"axis names must be distinct identifiers, got {list(axes)}",
                              where=where, hint="name the axes e.g. ['pipe', 'data']")
    for axis, dim in zip(axes, dims, strict=True):
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise UsageValueError(f"axis {axis!r} needs a positive int length, got {dim!r}",
                                  where=where, hint="every axis has at least one rank")


def _index(axis: str, value: Any, dim: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < dim:
        raise UsageValueError(f"{axis} coordinate {value!r} is outside the topology",
                              where="ProcessTopology.get_rank",
                              hint=f"{axis} runs over 0..{dim - 1}")
    return value
