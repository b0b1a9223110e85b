"""PipelineModule without torch.distributed: partitioning, building only the owned
layers, tied layers, checkpointing, and a 2-stage split chained by hand against the
unsplit model."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from deepshard.errors import UsageError
from deepshard.runtime.parallel.partition import partition_layers, partition_uniform
from deepshard.runtime.parallel.pipe_module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    layer_weights,
)
from deepshard.runtime.parallel.tied import TiedWeightGroups, tied_rank_groups
from deepshard.runtime.parallel.topology import Topology


def brute_force_heaviest(weights, parts) -> float:
    n = len(weights)
    return min(max(sum(weights[a:b]) for a, b in itertools.pairwise((0, *cuts, n)))
               for cuts in itertools.combinations(range(1, n), parts - 1))


# partition (pure) --------------------------------------------------------------------------

def test_uniform_puts_the_extra_layers_first():
    assert partition_uniform(7, 3) == (0, 3, 5, 7)
    assert partition_uniform(4, 4) == (0, 1, 2, 3, 4)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.data())
def test_balanced_split_is_optimal_and_non_empty(weights, data):
    parts = data.draw(st.integers(1, len(weights)))
    bounds = partition_layers(weights, parts)
    assert bounds[0] == 0 and bounds[-1] == len(weights) and len(bounds) == parts + 1
    assert all(a < b for a, b in itertools.pairwise(bounds))
    heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
    assert heaviest == brute_force_heaviest(weights, parts)


@given(st.integers(1, 30), st.data())
def test_equal_weights_split_like_uniform(n, data):
    parts = data.draw(st.integers(1, n))
    assert partition_layers([3] * n, parts) == partition_uniform(n, parts)


def test_balanced_spreads_weightless_layers():
    # embedding, four blocks, a lambda, a norm without params, the head
    assert partition_layers([0, 4, 4, 4, 4, 0, 0, 10], 3) == (0, 3, 6, 8)


def test_more_stages_than_layers_is_a_clear_error():
    with pytest.raises(UsageError, match="3 pipeline stages but only 2 layer") as err:
        partition_layers([1, 1], 3)
    assert "use at most 2 stage" in str(err.value)
    with pytest.raises(UsageError, match=r"PipelineModule\(num_stages=4\).*only 3 layer"):
        PipelineModule([nn.ReLU()] * 3, num_stages=4, stage_id=0)


# weights per method ------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_parameter_weights_count_on_meta_without_real_builds():
    built: list[torch.device] = []

    class Recorded(nn.Linear):
        def __init__(self, *args):
            super().__init__(*args)
            built.append(self.weight.device)

    specs = [LayerSpec(Recorded, 4, 8), lambda x: x * 2, nn.Linear(8, 2, bias=False),
             LayerSpec(Recorded, 2, 2)]
    assert layer_weights(specs, "parameters") == [40, 0, 16, 6]
    assert built == [torch.device("meta")] * 2


def test_type_regex_weights_and_errors():
    specs = [LayerSpec(nn.Embedding, 10, 4), LayerSpec(Block), Block(), nn.LayerNorm(4),
             lambda x: x]
    assert layer_weights(specs, "type:block") == [0, 1, 1, 0, 0]
    assert layer_weights(specs, "type:^(Block|LayerNorm)$") == [0, 1, 1, 1, 0]
    with pytest.raises(UsageError, match="matches no layer") as err:
        layer_weights(specs, "type:Transformer")
    assert "Block, Embedding, LayerNorm" in str(err.value)
    with pytest.raises(UsageError, match="bad regular expression"):
        layer_weights(specs, "type:(")
    with pytest.raises(UsageError, match="unknown partition_method 'profile'"):
        layer_weights(specs, "profile")


def test_type_partition_balances_the_matching_layers():
    specs = [LayerSpec(nn.Embedding, 10, 4), *[LayerSpec(Block) for _ in range(4)],
             LayerSpec(nn.LayerNorm, 4), LayerSpec(nn.Linear, 4, 10)]
    stages = [PipelineModule(specs, num_stages=2, stage_id=s, partition_method="type:Block")
              for s in range(2)]
    assert stages[0].parts == (0, 3, 7)
    assert [type(f).__name__ for f in stages[0].forward_funcs] == ["Embedding", "Block", "Block"]


def test_parameters_partition_balances_parameters():
    specs = [LayerSpec(nn.Linear, 16, 16), LayerSpec(nn.Linear, 16, 2),
             LayerSpec(nn.Linear, 2, 2), LayerSpec(nn.Linear, 2, 16)]  # 272, 34, 6, 48
    module = PipelineModule(specs, num_stages=2, stage_id=1)
    assert module.partitions() == (0, 1, 4)
    assert [module.stage_owner(i) for i in range(4)] == [0, 1, 1, 1]
    assert module.stage_layers == range(1, 4)


# building ----------------------------------------------------------------------------------

def test_only_the_owned_layers_are_built():
    built: list[tuple[int, str]] = []

    class Probe(nn.Module):
        def __init__(self, index: int):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            built.append((index, self.lin.weight.device.type))

        def forward(self, x):
            return self.lin(x)

    specs = [LayerSpec(Probe, i) for i in range(5)]
    for method in ("uniform", "parameters"):
        built.clear()
        module = PipelineModule(specs, num_stages=2, stage_id=1, partition_method=method)
        assert [i for i, dev in built if dev != "meta"] == [3, 4]
        assert sorted(name for name, _ in module.named_children()) == ["3", "4", "tied_modules"]
        assert set(module.state_dict()) == {"3.lin.weight", "3.lin.bias", "4.lin.weight",
                                             "4.lin.bias"}


def test_layer_spec_rejects_non_modules():
    with pytest.raises(UsageError, match=r"needs an nn\.Module subclass"):
        LayerSpec(torch.relu)
    assert repr(LayerSpec(nn.Linear, 4, 2, bias=False)) == "Linear(4, 2, bias=False)"
    with pytest.raises(UsageError, match="layer 1 is a int"):
        PipelineModule([nn.ReLU(), 3], num_stages=1, stage_id=0)


def test_placement_arguments():
    with pytest.raises(UsageError, match="give num_stages or topology"):
        PipelineModule([nn.ReLU()])
    with pytest.raises(UsageError, match="num_stages=3 but the topology has 2"):
        PipelineModule([nn.ReLU()] * 4, num_stages=3, topology=Topology(pipe=2))
    with pytest.raises(UsageError, match=r"stage_id 2 outside 0\.\.1"):
        PipelineModule([nn.ReLU()] * 4, num_stages=2, stage_id=2)
    with pytest.raises(UsageError, match=r"torch\.distributed is not initialised"):
        PipelineModule([nn.ReLU()] * 4, num_stages=2)
    topo = Topology(pipe=2, data=2, tensor=2)
    placed = PipelineModule([nn.ReLU()] * 4, topology=topo, rank=5)  # pipe 1
    assert (placed.stage_id, placed.num_stages, placed.topology()) == (1, 2, topo)
    assert placed.is_last_stage and not placed.is_first_stage


# tied layers -------------------------------------------------------------------------------

def tied_lm(vocab: int = 11, width: int = 4):
    """A tiny language model whose output projection is the embedding (DeepSpeed's
    usual example)."""
    return [
        TiedLayerSpec("embed", nn.Embedding, vocab, width),
        LayerSpec(Block, width),
        LayerSpec(Block, width),
        LayerSpec(nn.LayerNorm, width),
        TiedLayerSpec("embed", nn.Embedding, vocab, width,
                      forward_fn=lambda module, x: x @ module.weight.t()),
    ]


def test_tied_layers_share_one_module_per_stage():
    one = PipelineModule(tied_lm(), num_stages=1, stage_id=0, partition_method="uniform")
    assert one.tied_keys == ("embed",) and one.tied_groups() == {"embed": (0,)}
    assert len([p for p in one.parameters()]) == 1 + 4 + 2  # embedding counted once
    out = one(torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, 11)
    out.sum().backward()
    assert one.tied_weights()["embed"][0].grad is not None

    stages = [PipelineModule(tied_lm(), num_stages=2, stage_id=s, partition_method="uniform")
              for s in range(2)]
    assert all(s.tied_groups() == {"embed": (0, 1)} for s in stages)
    assert [s.tied_keys for s in stages] == [("embed",), ("embed",)]
    assert "tied_modules.embed.weight" in stages[1].state_dict()


def test_tied_rank_groups_plan():
    topo = Topology(pipe=3, data=2, tensor=2)
    plan = tied_rank_groups({"b": (0, 2), "a": (1,), "c": (0, 1, 2)}, topo)
    assert list(plan) == ["b", "c"]  # sorted, single-stage keys need no group
    assert plan["b"] == ((0, 8), (1, 9), (2, 10), (3, 11))
    assert plan["c"][3] == (3, 7, 11)


def test_tied_weight_groups_keep_this_ranks_groups():
    topo = Topology(pipe=2, data=2, tensor=1)
    calls = []

    def new_group(ranks):
        calls.append(tuple(ranks))
        return f"group{tuple(ranks)}"

    module = PipelineModule(tied_lm(), topology=topo, rank=3, partition_method="uniform")
    tied = TiedWeightGroups.create(module, topo, rank=3, new_group=new_group)
    assert calls == [(0, 2), (1, 3)]
    assert tied.ranks == {"embed": (1, 3)} and tied.groups == {"embed": "group(1, 3)"}
    assert tied.duplicates(module, rank=3) == module.tied_weights()["embed"]
    assert tied.duplicates(module, rank=1) == ()


# forward -----------------------------------------------------------------------------------

def mlp_specs():
    return [LayerSpec(nn.Linear, 6, 16), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 16, 16),
            lambda x: x * 0.5, LayerSpec(nn.Dropout, 0.0), LayerSpec(nn.Linear, 16, 16),
            LayerSpec(nn.GELU), LayerSpec(nn.Linear, 16, 3)]


def test_two_stage_split_equals_the_unsplit_model():
    torch.manual_seed(0)
    whole = PipelineModule(mlp_specs(), num_stages=1, stage_id=0)
    stages = [PipelineModule(mlp_specs(), num_stages=2, stage_id=s) for s in range(2)]
    for stage in stages:  # the same weights, by global layer index
        stage.load_state_dict({k: v for k, v in whole.state_dict().items()
                               if k in stage.state_dict()})
    x = torch.randn(5, 6)
    target = torch.randn(5, 3)

    expected = whole(x)
    torch.nn.functional.mse_loss(expected, target).backward()

    hidden = stages[0](x)
    received = hidden.detach().requires_grad_()  # what the next stage receives
    out = stages[1](received)
    torch.nn.functional.mse_loss(out, target).backward()
    hidden.backward(received.grad)  # the gradient sent back

    assert torch.equal(out, expected)
    grads = {k: p.grad for s in stages for k, p in s.named_parameters()}
    assert set(grads) == {k for k, _ in whole.named_parameters()}
    for name, param in whole.named_parameters():
        assert torch.equal(grads[name], param.grad), name


def test_seed_layers_makes_weights_independent_of_the_stage():
    whole = PipelineModule(mlp_specs(), num_stages=1, stage_id=0, seed_layers=True)
    torch.manual_seed(123)  # a different global state must not matter
    second = PipelineModule(mlp_specs(), num_stages=2, stage_id=1, seed_layers=True)
    for name, param in second.state_dict().items():
        assert torch.equal(param, whole.state_dict()[name]), name


@pytest.mark.parametrize("interval", [1, 2, 3, 100])
def test_activation_checkpointing_gives_the_same_gradients(interval):
    torch.manual_seed(1)
    plain = PipelineModule(mlp_specs(), num_stages=1, stage_id=0)
    ckpt = PipelineModule(mlp_specs(), num_stages=1, stage_id=0,
                          activation_checkpoint_interval=interval)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(4, 6)
    plain(x).square().sum().backward()
    ckpt(x).square().sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters(),
                                 strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_checkpointing_calls_the_given_function_on_chunks_with_parameters():
    chunks = []

    def spy(function, *args):
        chunks.append(function)
        return function(*args)

    module = PipelineModule(mlp_specs(), num_stages=1, stage_id=0,
                            activation_checkpoint_interval=2, activation_checkpoint_func=spy)
    module(torch.randn(2, 6))
    assert len(chunks) == 4  # layers 0-1, 2-3, 4-5, 6-7 each hold a Linear
    module = PipelineModule(mlp_specs(), num_stages=1, stage_id=0,
                            activation_checkpoint_interval=1, activation_checkpoint_func=spy,
                            checkpointable_layers=["Tanh"])
    chunks.clear()
    module(torch.randn(2, 6))
    assert len(chunks) == 1
