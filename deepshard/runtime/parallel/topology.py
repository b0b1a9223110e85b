"""The (pipe, data, sequence, tensor) grid of ranks, and the process groups along its axes.

:class:`Topology` is pure arithmetic over the sizes ``P x D x S x T``. Ranks are laid out
as DeepSpeed's ``PipeModelDataParallelTopology`` lays them out: row-major over the axes
``(pipe, data, tensor)``, so the tensor coordinate varies fastest (tensor-parallel peers
are adjacent ranks, hence on one node), then data, then pipe. Ulysses sequence parallelism
(``S``, default 1) is carved out of the data-parallel ranks as DeepSpeed carves it:
consecutive data-parallel ranks form a sequence-parallel group, so the ``D`` data-parallel
replicas are the groups (one batch each) and ``D x S`` ranks reduce gradients together::

    rank = ((pipe * D + data) * S + sequence) * T + tensor

:class:`ProcessGroups` is the one side effect: it creates every group of every axis with
``torch.distributed.new_group`` (each rank must create all groups, in the same order:
torch's rule) and keeps the ones this rank belongs to, behind Megatron's ``mpu``
interface, which DeepSpeed's engine and tensor-parallel code expect.

DeepSpeed's names: a :class:`Topology` is also a
:class:`~deepshard.runtime.parallel.process_topology.ProcessTopology` over the axes
``pipe, data[, sequence], model`` (DeepSpeed calls the tensor axis ``model``), so
``get_coord``, ``get_axis_comm_lists`` and the rest answer for it;
:func:`PipeDataParallelTopology` and :func:`PipeModelDataParallelTopology` build one under
DeepSpeed's axis lists, and :func:`PipelineParallelGrid` is DeepSpeed's grid constructor.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

from deepshard.comm.teardown import keep
from deepshard.errors import UsageError, UsageValueError
from deepshard.runtime.parallel.process_topology import ProcessTopology

Axis = Literal["pipe", "data", "sequence", "tensor"]
AXES: tuple[Axis, ...] = ("pipe", "data", "sequence", "tensor")
"""The axes, slowest-varying first."""

PIPE_KEY = "pipeline.stages"
TENSOR_KEY = "tensor_parallel.autotp_size"
SEQUENCE_KEY = "sequence_parallel_size"

DS_AXIS = MappingProxyType({"pipe": "pipe", "data": "data", "sequence": "sequence",
                            "model": "tensor"})
"""DeepSpeed's axis names (what :class:`ProcessTopology` methods take) -> the field."""
_DS_COORDS: MappingProxyType[tuple[str, ...], type] = MappingProxyType({
    axes: namedtuple("ProcessCoord", axes)
    for axes in (("pipe", "data"), ("pipe", "data", "model"), ("pipe", "data", "sequence"),
                 ("pipe", "data", "sequence", "model"))})


class Coord(NamedTuple):
    """Where one rank sits in the grid."""

    pipe: int
    data: int
    tensor: int
    sequence: int = 0


@dataclass(frozen=True)
class Topology(ProcessTopology):
    """A ``pipe x data x sequence x tensor`` grid of ``world = pipe * data * sequence *
    tensor`` ranks; as a :class:`ProcessTopology`, its axes are :attr:`ds_axes` (see the
    module docstring)."""

    pipe: int = 1
    """Pipeline stages (P)."""
    data: int = 1
    """Data-parallel replicas (D)."""
    tensor: int = 1
    """Tensor-parallel degree (T)."""
    sequence: int = 1
    """Ranks of one Ulysses sequence-parallel group (S): a data-parallel replica."""
    ds_axes: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """DeepSpeed's axis list this grid answers to as a :class:`ProcessTopology`, in layout
    order (``("pipe", "data")`` from :func:`PipeDataParallelTopology`); empty: ``pipe,
    data, model``, with ``sequence`` before ``model`` when it is larger than 1. An axis
    left out must have size 1."""

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"topology axis {axis!r} needs a positive int, got {size!r}")
        axes = self.ds_axes or ("pipe", "data", *(("sequence",) * (self.sequence > 1)),
                                "model")
        if axes not in _DS_COORDS or any(getattr(self, attr) > 1 for name, attr in
                                         DS_AXIS.items() if name not in axes):
            raise ValueError(f"axes {axes} do not describe the topology {self}")
        object.__setattr__(self, "ds_axes", axes)

    def _grid(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        return self.ds_axes, tuple(getattr(self, DS_AXIS[a]) for a in self.ds_axes)

    def _coord_type(self) -> type:
        return _DS_COORDS[self.ds_axes]

    def get_rank(self, **coord: int) -> int:
        """:meth:`ProcessTopology.get_rank`; an axis of size 1 that :attr:`ds_axes` leaves
        out may be given too (as 0), so DeepSpeed code written for ``pipe, data, model``
        works on a ``pipe, data`` grid."""
        extra = {a: v for a, v in coord.items() if a not in self.ds_axes and a in DS_AXIS}
        for axis, value in extra.items():
            if value != 0:
                raise UsageValueError(f"{axis} coordinate {value!r} is outside the topology",
                                      where="ProcessTopology.get_rank",
                                      hint=f"{axis} has size 1: its coordinate is 0")
        return super().get_rank(**{a: v for a, v in coord.items() if a not in extra})

    def __str__(self) -> str:
        return repr(self)

    @classmethod
    def from_process_topology(cls, topology: ProcessTopology) -> Topology:
        """A DeepSpeed ``ProcessTopology`` as deepshard's grid: its axes must be among
        ``pipe, data, sequence, model`` in that order (the layout deepshard's groups use).

        Raises:
            UsageError: other axes, or another order.
        """
        if isinstance(topology, Topology):
            return topology
        axes = topology.get_axis_names()
        if axes != [a for a in DS_AXIS if a in axes]:
            raise UsageError(f"deepshard's process groups lay ranks out over pipe, data, "
                             f"sequence, model (in that order); this topology's axes are "
                             f"{list(axes)}", where="PipelineParallelGrid(topology)",
                             hint="build it with PipeModelDataParallelTopology or "
                                  "PipeDataParallelTopology")
        named = tuple(a for a in DS_AXIS if a in axes or a in ("pipe", "data"))
        return cls(**{DS_AXIS[a]: topology.get_dim(a) for a in axes}, ds_axes=named)

    @classmethod
    def from_config(cls, world: int, pipe_stages: int = 1, tp_size: int = 1,
                    sp_size: int = 1) -> Topology:
        """The topology of a job of ``world`` ranks: the data axis takes what pipeline,
        tensor and sequence parallelism leave. Raises :class:`UsageError` naming the config
        keys when ``world`` is not divisible by ``pipe_stages * tp_size * sp_size``."""
        keys = ((PIPE_KEY, pipe_stages), (TENSOR_KEY, tp_size), (SEQUENCE_KEY, sp_size))
        for key, value in keys:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"must be a positive integer, got {value!r}", where=key,
                                 hint=f"set {key} to 1 to turn this kind of parallelism off")
        if world < 1:
            raise ValueError(f"world size must be positive, got {world}")
        named = [(k, v) for k, v in keys if v > 1 or k != SEQUENCE_KEY]
        model = pipe_stages * tp_size * sp_size
        if world % model:
            fits = [d for d in range(1, world + 1) if world % d == 0]
            sizes = " x ".join(f"{k} ({v})" for k, v in named)
            raise UsageError(
                f"world size {world} is not divisible by {sizes} = {model}, so no whole "
                f"number of data-parallel replicas fits",
                where=" x ".join(k for k, _ in named),
                hint=f"pick them so that their product divides {world} (one of "
                     f"{', '.join(map(str, fits))}), or launch a multiple of {model} ranks")
        return cls(pipe=pipe_stages, data=world // model, tensor=tp_size, sequence=sp_size)

    @property
    def world(self) -> int:
        """Number of ranks in the grid."""
        return self.pipe * self.data * self.sequence * self.tensor

    def size(self, axis: Axis) -> int:
        """The size of ``axis``."""
        return getattr(self, _checked_axis(axis))

    def rank(self, pipe: int = 0, data: int = 0, tensor: int = 0, sequence: int = 0) -> int:
        """The global rank at these coordinates."""
        for axis, value in (("pipe", pipe), ("data", data), ("tensor", tensor),
                            ("sequence", sequence)):
            if not 0 <= value < getattr(self, axis):
                raise ValueError(f"{axis} coordinate {value} outside 0..{getattr(self, axis) - 1}")
        return ((pipe * self.data + data) * self.sequence + sequence) * self.tensor + tensor

    def coord(self, rank: int) -> Coord:
        """The coordinates of global ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside 0..{self.world - 1}")
        rest, tensor = divmod(rank, self.tensor)
        rest, sequence = divmod(rest, self.sequence)
        pipe, data = divmod(rest, self.data)
        return Coord(pipe, data, tensor, sequence)

    def axis_groups(self, axis: Axis) -> tuple[tuple[int, ...], ...]:
        """Every group of ranks that differ only in their ``axis`` coordinate, each in
        increasing ``axis`` coordinate, groups ordered by their smallest rank. Together
        they partition the world."""
        return self._groups((_checked_axis(axis),))

    def sequence_data_groups(self) -> tuple[tuple[int, ...], ...]:
        """The groups that reduce gradients (and shard ZeRO state): all ``data x sequence``
        ranks sharing pipe and tensor coordinates, every rank holding the same weights."""
        return self._groups(("data", "sequence"))

    def model_parallel_groups(self) -> tuple[tuple[int, ...], ...]:
        """The "model parallel" groups: all ``pipe x tensor`` ranks sharing one data
        coordinate (one whole replica of the model), as Megatron's ``mpu`` defines them."""
        return self._groups(("pipe", "tensor"))

    def group_of(self, axis: Axis, rank: int) -> tuple[int, ...]:
        """The ``axis`` group holding ``rank``."""
        here = self.coord(rank)
        ranges = {a: [getattr(here, a)] for a in AXES}
        ranges[_checked_axis(axis)] = list(range(self.size(axis)))
        return tuple(self._at(c) for c in itertools.product(*(ranges[a] for a in AXES)))

    def _at(self, coords: tuple[int, ...]) -> int:
        """The rank at coordinates given in :data:`AXES` order."""
        return self.rank(**dict(zip(AXES, coords, strict=True)))

    def stage_rank(self, rank: int, stage: int) -> int:
        """The rank that holds pipeline ``stage`` for ``rank``'s data and tensor
        coordinates (``rank``'s peer in its pipe group)."""
        here = self.coord(rank)
        return self.rank(stage, here.data, here.tensor, here.sequence)

    def prev_stage_rank(self, rank: int) -> int | None:
        """The rank ``rank`` receives activations from (and sends gradients to); ``None``
        on the first stage."""
        stage = self.coord(rank).pipe
        return None if stage == 0 else self.stage_rank(rank, stage - 1)

    def next_stage_rank(self, rank: int) -> int | None:
        """The rank ``rank`` sends activations to (and receives gradients from); ``None``
        on the last stage."""
        stage = self.coord(rank).pipe
        return None if stage == self.pipe - 1 else self.stage_rank(rank, stage + 1)

    def _groups(self, varying: tuple[Axis, ...]) -> tuple[tuple[int, ...], ...]:
        fixed = [a for a in AXES if a not in varying]
        groups = []
        for kept in itertools.product(*(range(self.size(a)) for a in fixed)):
            ranges: dict[str, Any] = {a: range(self.size(a)) for a in varying}
            ranges.update({a: (v,) for a, v in zip(fixed, kept, strict=True)})
            groups.append(tuple(sorted(
                self._at(c) for c in itertools.product(*(ranges[a] for a in AXES)))))
        return tuple(sorted(groups))


def PipeModelDataParallelTopology(num_pp: int, num_mp: int, num_dp: int) -> Topology:
    """DeepSpeed's constructor name and argument order, for ported scripts: axes ``pipe,
    data, model``."""
    return Topology(pipe=num_pp, data=num_dp, tensor=num_mp,
                    ds_axes=("pipe", "data", "model"))


def PipeDataParallelTopology(num_pp: int, num_dp: int) -> Topology:
    """DeepSpeed's constructor name and argument order, for ported scripts: axes ``pipe,
    data``."""
    return Topology(pipe=num_pp, data=num_dp, tensor=1, ds_axes=("pipe", "data"))


def PipelineParallelGrid(topology: ProcessTopology | None = None,
                         process_group: Any = None) -> ProcessGroups:
    """DeepSpeed's grid: this rank's :class:`ProcessGroups` over ``topology`` (a collective
    call on every rank, after ``init_distributed``).

    Without a topology, the world's prime factors are dealt out in turn to pipe and data,
    as DeepSpeed does (4 ranks: 2 stages x 2 replicas). ``process_group`` is accepted and
    not used (DeepSpeed's is not either). The grid's ``topology`` is an attribute, where
    DeepSpeed's is a method.

    Raises:
        UsageError: a topology whose axes deepshard cannot lay out (see
            :meth:`Topology.from_process_topology`), or one that does not cover the world.
    """
    del process_group
    if topology is None:
        import torch.distributed as dist

        pipe = data = 1
        for i, prime in enumerate(_prime_factors(dist.get_world_size())):
            if i % 2 == 0:
                pipe *= prime
            else:
                data *= prime
        topology = PipeDataParallelTopology(num_pp=pipe, num_dp=data)
    return ProcessGroups.create(Topology.from_process_topology(topology))


def _prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


def _checked_axis(axis: str) -> Axis:
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; the axes are {', '.join(AXES)}")
    return axis


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's process groups in a :class:`Topology`, with Megatron's ``mpu`` methods.

    Build it with :meth:`create` on every rank. The ``get_*`` methods are Megatron's
    ``mpu`` interface (and DeepSpeed's ``PipelineParallelGrid`` spellings): pass this
    object where DeepSpeed code expects ``mpu``. Group fields are
    ``torch.distributed.ProcessGroup`` objects (typed ``Any`` so that this module stays
    importable for pure use).
    """

    topology: Topology
    rank: int
    pipe_group: Any
    data_group: Any
    tensor_group: Any
    model_group: Any
    sequence_group: Any = None
    """This rank's sequence-parallel group; ``None`` without sequence parallelism."""
    sequence_data_group: Any = None
    """The ``data x sequence`` ranks gradients are reduced over; ``None`` without sequence
    parallelism (then it is ``data_group``)."""

    @classmethod
    def create(cls, topology: Topology, rank: int | None = None,
               new_group: Callable[[list[int]], Any] | None = None) -> ProcessGroups:
        """Create every group of every axis (a collective call: every rank of the job must
        call this, with the same topology) and keep this rank's.

        Groups are created in one fixed order, the same on every rank: the pipe groups,
        the data groups, the tensor groups, then the model-parallel groups, each in
        :meth:`Topology.axis_groups` order; with sequence parallelism, then the sequence
        groups and the sequence-data groups. ``rank`` defaults to
        ``torch.distributed.get_rank()``; ``new_group`` to ``torch.distributed.new_group``
        (replaceable in tests).
        """
        import torch.distributed as dist

        if rank is None:
            rank = dist.get_rank()
        if new_group is None:
            new_group = dist.new_group
            world = dist.get_world_size()
            if world != topology.world:
                raise UsageError(
                    f"the job has {world} ranks but the topology {topology.pipe} (pipe) x "
                    f"{topology.data} (data) x {topology.tensor} (tensor) has {topology.world}",
                    where=f"{PIPE_KEY} x {TENSOR_KEY}",
                    hint="build the topology with Topology.from_config(world, ...)")
        mine: dict[str, Any] = {}
        plan = [(a, topology.axis_groups(a)) for a in ("pipe", "data", "tensor")]
        plan.append(("model", topology.model_parallel_groups()))
        if topology.sequence > 1:
            plan.append(("sequence", topology.axis_groups("sequence")))
            plan.append(("sequence_data", topology.sequence_data_groups()))
        for name, groups in plan:
            for ranks in groups:
                group = new_group(list(ranks))
                keep(group)  # never destructed: see comm/teardown.py
                if rank in ranks:
                    mine[name] = group
        return cls(topology, rank, mine["pipe"], mine["data"], mine["tensor"], mine["model"],
                   mine.get("sequence"), mine.get("sequence_data"))

    @property
    def coord(self) -> Coord:
        """This rank's coordinates."""
        return self.topology.coord(self.rank)

    @property
    def stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.coord.pipe

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank of the previous stage's peer (p2p source of activations)."""
        return self.topology.prev_stage_rank(self.rank)

    @property
    def next_stage_rank(self) -> int | None:
        """Global rank of the next stage's peer (p2p destination of activations)."""
        return self.topology.next_stage_rank(self.rank)

    # Megatron's mpu interface ------------------------------------------------------------

    def get_data_parallel_group(self) -> Any:
        return self.data_group

    def get_data_parallel_world_size(self) -> int:
        return self.topology.data

    def get_data_parallel_rank(self) -> int:
        return self.coord.data

    def get_model_parallel_group(self) -> Any:
        return self.model_group

    def get_model_parallel_world_size(self) -> int:
        return self.topology.pipe * self.topology.tensor

    def get_model_parallel_rank(self) -> int:
        """Position in the model-parallel group (``pipe * T + tensor``)."""
        return self.coord.pipe * self.topology.tensor + self.coord.tensor

    def get_tensor_model_parallel_group(self) -> Any:
        return self.tensor_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.topology.tensor

    def get_tensor_model_parallel_rank(self) -> int:
        return self.coord.tensor

    def get_pipeline_model_parallel_group(self) -> Any:
        return self.pipe_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.topology.pipe

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.coord.pipe

    # DeepSpeed's PipelineParallelGrid spellings
    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_rank = get_tensor_model_parallel_rank

    # DeepSpeed's sequence-parallel mpu (deepspeed.utils.groups, parallel_state_sp)

    def get_sequence_parallel_group(self) -> Any:
        return self.sequence_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.topology.sequence

    def get_sequence_parallel_rank(self) -> int:
        return self.coord.sequence

    def get_sequence_data_parallel_group(self) -> Any:
        """The ``data x sequence`` ranks: ZeRO's partition group and where gradients are
        reduced."""
        return self.sequence_data_group if self.topology.sequence > 1 else self.data_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.topology.data * self.topology.sequence

    def get_sequence_data_parallel_rank(self) -> int:
        return self.coord.data * self.topology.sequence + self.coord.sequence

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.coord.data

    # the rest of DeepSpeed's PipelineParallelGrid

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the first pipeline stage."""
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage."""
        return self.stage_id == self.topology.pipe - 1

    def get_global_rank(self) -> int:
        """This rank's global rank."""
        return self.rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        """The global ranks of this rank's data-parallel group."""
        return list(self.topology.group_of("data", self.rank))

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank holding ``stage_id`` at this rank's other coordinates, some of
        which ``kwargs`` may replace (DeepSpeed's axis names: ``data=``, ``model=``)."""
        here = self.topology.get_coord(self.rank)._replace(pipe=stage_id, **kwargs)
        return self.topology.get_rank(**here._asdict())
