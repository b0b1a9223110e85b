"""The (pipe, data, sequence, tensor) grid: rank layout, axis groups, config errors, and the groups
ProcessGroups creates (with a recording stand-in for torch.distributed.new_group)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepshard.errors import UsageError
from deepshard.runtime.parallel.topology import (
    AXES,
    Coord,
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessGroups,
    Topology,
)

sizes = st.integers(1, 4)


def test_layout_is_tensor_fastest_then_data_then_pipe():
    topo = Topology(pipe=2, data=3, tensor=2)
    assert topo.world == 12
    expected = [(*c, 0) for c in itertools.product(range(2), range(3), range(2))]
    assert [tuple(topo.coord(r)) for r in range(12)] == expected  # row-major
    assert topo.coord(7) == Coord(pipe=1, data=0, tensor=1)
    assert topo.rank(pipe=1, data=2, tensor=0) == 10


def test_groups_of_a_2x2x2_grid():
    topo = Topology(2, 2, 2)
    assert topo.axis_groups("tensor") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert topo.axis_groups("data") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert topo.axis_groups("pipe") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert topo.model_parallel_groups() == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert topo.group_of("data", 5) == (5, 7)


@given(sizes, sizes, sizes)
def test_rank_and_coord_are_inverse(p, d, t):
    topo = Topology(p, d, t)
    for rank in range(topo.world):
        assert topo.rank(*topo.coord(rank)) == rank


@given(sizes, sizes, sizes, st.integers(1, 3), st.sampled_from(AXES))
def test_axis_groups_partition_the_world(p, d, t, sp, axis):
    topo = Topology(p, d, t, sequence=sp)
    groups = topo.axis_groups(axis)
    assert sorted(r for g in groups for r in g) == list(range(topo.world))
    assert len(groups) == topo.world // topo.size(axis)
    others = [a for a in AXES if a != axis]
    for group in groups:
        assert len(group) == topo.size(axis)
        coords = [topo.coord(r) for r in group]
        assert [getattr(c, axis) for c in coords] == list(range(topo.size(axis)))
        assert len({tuple(getattr(c, a) for a in others) for c in coords}) == 1
        assert all(topo.group_of(axis, r) == group for r in group)


@given(sizes, sizes, sizes)
def test_model_parallel_groups_are_one_replica_each(p, d, t):
    topo = Topology(p, d, t)
    groups = topo.model_parallel_groups()
    assert len(groups) == d
    for data, group in enumerate(groups):
        assert len(group) == p * t
        assert {topo.coord(r).data for r in group} == {data}


def test_neighbour_stages_keep_data_and_tensor():
    topo = Topology(3, 2, 2)
    rank = topo.rank(1, 1, 0)
    assert topo.prev_stage_rank(rank) == topo.rank(0, 1, 0)
    assert topo.next_stage_rank(rank) == topo.rank(2, 1, 0)
    assert topo.prev_stage_rank(topo.rank(0, 1, 1)) is None
    assert topo.next_stage_rank(topo.rank(2, 0, 1)) is None


def test_from_config_gives_data_the_rest():
    assert Topology.from_config(16, pipe_stages=2, tp_size=4) == Topology(2, 2, 4)
    assert Topology.from_config(3) == Topology(1, 3, 1)


def test_from_config_names_keys_and_arithmetic():
    with pytest.raises(UsageError) as err:
        Topology.from_config(6, pipe_stages=4, tp_size=1)
    text = str(err.value)
    assert "pipeline.stages" in text and "tensor_parallel.autotp_size" in text
    assert "world size 6 is not divisible by" in text and "(4) x" in text and "= 4" in text
    assert "1, 2, 3, 6" in text  # the products that would fit
    with pytest.raises(UsageError, match=r"tensor_parallel\.autotp_size: must be a positive"):
        Topology.from_config(4, pipe_stages=1, tp_size=0)
    with pytest.raises(UsageError, match=r"pipeline\.stages: must be a positive"):
        Topology.from_config(4, pipe_stages=-2)


def test_bad_sizes_and_coordinates():
    with pytest.raises(ValueError, match="positive int"):
        Topology(pipe=0)
    topo = Topology(2, 1, 1)
    with pytest.raises(ValueError, match="rank 2 outside"):
        topo.coord(2)
    with pytest.raises(ValueError, match="pipe coordinate 2"):
        topo.rank(pipe=2)
    with pytest.raises(ValueError, match="unknown axis"):
        topo.axis_groups("model")  # type: ignore[arg-type]


def test_deepspeed_constructor_names():
    assert PipeModelDataParallelTopology(num_pp=2, num_mp=4, num_dp=3) == Topology(2, 3, 4)
    assert PipeDataParallelTopology(num_pp=2, num_dp=3) == Topology(2, 3, 1)


def _create(topo: Topology, rank: int) -> tuple[ProcessGroups, list[tuple[int, ...]]]:
    calls: list[tuple[int, ...]] = []

    def new_group(ranks):
        calls.append(tuple(ranks))
        return tuple(ranks)  # the "group" is its member list

    return ProcessGroups.create(topo, rank, new_group=new_group), calls


def test_every_rank_creates_every_group_in_one_order():
    topo = Topology(2, 2, 2)
    orders = [_create(topo, rank)[1] for rank in range(topo.world)]
    assert all(order == orders[0] for order in orders)
    assert len(orders[0]) == 4 + 4 + 4 + 2


def test_groups_and_mpu_of_one_rank():
    topo = Topology(2, 2, 2)
    pg, _ = _create(topo, rank=5)  # pipe 1, data 0, tensor 1
    assert pg.get_pipeline_model_parallel_group() == (1, 5)
    assert pg.get_data_parallel_group() == (5, 7)
    assert pg.get_tensor_model_parallel_group() == (4, 5)
    assert pg.get_model_parallel_group() == (0, 1, 4, 5)
    assert (pg.get_data_parallel_rank(), pg.get_data_parallel_world_size()) == (0, 2)
    assert (pg.get_tensor_model_parallel_rank(), pg.get_tensor_model_parallel_world_size()) \
        == (1, 2)
    assert (pg.get_pipeline_model_parallel_rank(),
            pg.get_pipeline_model_parallel_world_size()) == (1, 2)
    assert (pg.get_model_parallel_rank(), pg.get_model_parallel_world_size()) == (3, 4)
    # the model-parallel rank is the position in the model-parallel group
    assert pg.get_model_parallel_group().index(5) == pg.get_model_parallel_rank()
    assert (pg.prev_stage_rank, pg.next_stage_rank) == (1, None)
    assert pg.stage_id == pg.get_stage_id() == 1


def test_sequence_groups_are_consecutive_data_parallel_ranks():
    topo = Topology(data=2, sequence=2)  # DeepSpeed: SP groups of consecutive ranks
    assert topo.axis_groups("sequence") == ((0, 1), (2, 3))
    assert topo.axis_groups("data") == ((0, 2), (1, 3))
    assert topo.sequence_data_groups() == ((0, 1, 2, 3),)
    assert topo.coord(3) == Coord(pipe=0, data=1, tensor=0, sequence=1)
    with_tp = Topology(data=2, tensor=2, sequence=2)
    assert with_tp.axis_groups("sequence") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert with_tp.sequence_data_groups() == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert with_tp.model_parallel_groups() == ((0, 1), (2, 3), (4, 5), (6, 7))


@given(sizes, sizes, sizes, st.integers(1, 3))
def test_rank_and_coord_are_inverse_with_sequence(p, d, t, sp):
    topo = Topology(p, d, t, sequence=sp)
    assert [topo.rank(*topo.coord(r)) for r in range(topo.world)] == list(range(topo.world))


def test_sequence_parallel_size_in_the_config():
    assert Topology.from_config(8, sp_size=2) == Topology(data=4, sequence=2)
    with pytest.raises(UsageError, match=r"sequence_parallel_size \(4\) = 4"):
        Topology.from_config(6, sp_size=4)


def test_sequence_groups_and_mpu():
    topo = Topology(data=2, sequence=2)
    orders = [_create(topo, rank)[1] for rank in range(topo.world)]
    assert all(order == orders[0] for order in orders)
    pg, _ = _create(topo, rank=3)
    assert pg.get_sequence_parallel_group() == (2, 3)
    assert (pg.get_sequence_parallel_rank(), pg.get_sequence_parallel_world_size()) == (1, 2)
    assert pg.get_sequence_data_parallel_group() == (0, 1, 2, 3)
    assert (pg.get_sequence_data_parallel_rank(),
            pg.get_sequence_data_parallel_world_size()) == (3, 4)
    assert (pg.get_data_parallel_group(), pg.get_data_parallel_world_size()) == ((1, 3), 2)
    plain, calls = _create(Topology(data=4), rank=1)
    assert plain.get_sequence_data_parallel_group() == plain.get_data_parallel_group()
    assert plain.get_sequence_parallel_world_size() == 1 and len(calls) == 4 + 1 + 4 + 4
