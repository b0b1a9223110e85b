"""ZeRO's pure shard math and planning, and the NVMe swapper."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepshard.errors import UsageError
from deepshard.runtime.zero.partition import (
    ShardSpec,
    layout,
    pieces,
    plan_groups,
    split_by_size,
)
from deepshard.runtime.zero.stage3 import plan_units
from deepshard.runtime.zero.swap import TensorSwapper
from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT, GPTConfig


@given(st.lists(st.integers(1, 50), min_size=1, max_size=12), st.integers(1, 9))
@settings(max_examples=200, deadline=None)
def test_pieces_cover_every_element_exactly_once(numels, world):
    flat = layout(list(range(len(numels))), numels)
    spec = ShardSpec(flat.numel, world)
    assert spec.padded % world == 0 and 0 <= spec.padded - flat.numel < world
    seen = [0] * flat.numel
    for rank in range(world):
        lo, hi = spec.bounds(rank)
        assert hi - lo == spec.shard
        for pc in pieces(flat, spec, rank):
            assert pc.shard_start >= 0 and pc.shard_start + pc.length <= spec.shard
            start = flat.offsets[pc.param] + pc.param_start
            assert start == lo + pc.shard_start
            for e in range(start, start + pc.length):
                seen[e] += 1
    assert seen == [1] * flat.numel


def test_shard_spec_of_an_empty_buffer_and_bad_ranks():
    assert ShardSpec(0, 4).shard == 0 and ShardSpec(0, 4).padded == 0
    with pytest.raises(ValueError):
        ShardSpec(10, 2).bounds(2)


def test_split_by_size():
    assert split_by_size([3, 3, 3, 10, 1], 6) == [[0, 1], [2], [3], [4]]
    assert split_by_size([], 5) == []
    with pytest.raises(ValueError):
        split_by_size([1], 0)


def test_groups_never_mix_dtypes_or_optimizer_groups_and_follow_backward_order():
    numels = [10, 20, 30, 40, 50]
    dtypes = ["f32", "f32", "bf16", "f32", "f32"]
    plans = plan_groups(numels, dtypes, [[0, 1, 2], [3, 4]], cap=45)
    for plan in plans:
        assert len({dtypes[i] for i in plan.params}) == 1
        assert len({0 if i < 3 else 1 for i in plan.params}) == 1
        assert not plan.partitioned and plan.unit is None
        assert sum(numels[i] for i in plan.params) <= 45 or len(plan.params) == 1
    assert sorted(i for p in plans for i in p.params) == [0, 1, 2, 3, 4]
    assert plans[0].params == (4,)  # the last registered parameter's gradient comes first


def test_stage3_groups_split_units_from_small_persistent_parameters():
    numels = [100, 5, 100, 5, 7]
    plans = plan_groups(numels, ["f"] * 5, [[0, 1, 2, 3, 4]], cap=1000,
                        units=[[4], [0, 1], [2, 3]], persistence_threshold=50)
    partitioned = {p.unit: p.params for p in plans if p.partitioned}
    assert partitioned == {1: (0,), 2: (2,)}
    replicated = [p for p in plans if not p.partitioned]
    assert sorted(i for p in replicated for i in p.params) == [1, 3, 4]


def test_units_of_a_gpt_are_its_blocks_and_the_root():
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=3, n_head=2, d_model=16))
    names = [n for n, _ in model.named_parameters()]
    plan = plan_units(model, names)
    assert plan.modules == ("", "blocks.0", "blocks.1", "blocks.2")
    assert all(n.startswith("blocks.1.") for n in plan.params[2])
    assert set(plan.params[0]) == {n for n in names if not n.startswith("blocks.")}
    assert sorted(n for ps in plan.params for n in ps) == sorted(names)


def test_a_parameter_shared_by_two_units_belongs_to_the_root():
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    blocks[1].weight = blocks[0].weight
    model = torch.nn.Module()
    model.blocks = blocks
    plan = plan_units(model, [n for n, _ in model.named_parameters()])
    assert "blocks.0.weight" in plan.params[0]


class _MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(4, 2)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])


def test_a_leaf_module_is_one_unit_never_split():
    """``set_z3_leaf_modules``: the experts' ModuleList inside the leaf would make two units;
    the leaf is gathered whole instead (DeepSpeed's MoE use)."""
    from deepshard.runtime.zero.marks import get_z3_leaf_modules, set_z3_leaf_modules

    model = torch.nn.Module()
    model.moe = _MoE()
    names = [n for n, _ in model.named_parameters()]
    assert plan_units(model, names).modules == ("", "moe.experts.0", "moe.experts.1")
    assert set_z3_leaf_modules(model, [_MoE]) == [model.moe]
    assert get_z3_leaf_modules(model) == [model.moe]
    plan = plan_units(model, names)
    assert plan.modules == ("", "moe")
    assert sorted(plan.params[1]) == sorted(names)
    with pytest.raises(ValueError, match="no modules of type"):
        set_z3_leaf_modules(model, [torch.nn.Conv2d])


def test_a_registered_external_parameter_belongs_to_the_root():
    """``register_external_parameter(b, a.weight)``: b's forward uses a's weight, so it must
    be gathered around both units: the root's."""
    from deepshard.runtime.zero.marks import (
        register_external_parameter,
        unregister_external_parameter,
    )

    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    model = torch.nn.Module()
    model.blocks = blocks
    names = [n for n, _ in model.named_parameters()]
    assert "blocks.0.weight" in plan_units(model, names).params[1]
    register_external_parameter(blocks[1], blocks[0].weight)
    assert "blocks.0.weight" in plan_units(model, names).params[0]
    unregister_external_parameter(blocks[1], blocks[0].weight)
    assert "blocks.0.weight" in plan_units(model, names).params[1]
    with pytest.raises(RuntimeError, match="not a registered external parameter"):
        unregister_external_parameter(blocks[1], blocks[0].weight)


def test_swapper_round_trip_and_cleanup(tmp_path):
    swapper = TensorSwapper(tmp_path, rank=3, name="t")
    a = torch.arange(1000, dtype=torch.float32)
    b = torch.randn(77).to(torch.bfloat16)
    swapper.write("a", a).result()
    swapper.write("b", b).result()
    assert swapper.nbytes() == 4000 + 154
    out_a, out_b = torch.empty_like(a), torch.empty_like(b)
    for f in (swapper.read("a", out_a), swapper.read("b", out_b)):
        f.result()
    assert torch.equal(out_a, a) and torch.equal(out_b, b)
    with pytest.raises(ValueError):
        swapper.read("a", torch.empty(3))
    directory = swapper.directory
    assert directory.is_dir()
    swapper.close()
    assert not directory.exists()


def test_swapper_needs_a_writable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UsageError, match="NVMe offload directory"):
        TensorSwapper(blocker / "sub", rank=0, name="t")


def test_stage3_root_parameters_group_where_they_are_registered():
    """The root's parameters registered before the units (embeddings) reduce last, those
    registered after them (a head) first, each in groups of their own."""
    numels = [100, 100, 100, 100, 100]
    # 0: embedding (root), 1-2: two units, 3: norm (root, small), 4: head (root)
    numels[3] = 5
    plans = plan_groups(numels, ["f"] * 5, [[0, 1, 2, 3, 4]], cap=1000,
                        units=[[0, 3, 4], [1], [2]], persistence_threshold=50)
    partitioned = [(p.unit, p.params) for p in plans if p.partitioned]
    assert partitioned == [(0, (4,)), (2, (2,)), (1, (1,)), (0, (0,))]
    assert [p.params for p in plans if not p.partitioned] == [(3,)]
