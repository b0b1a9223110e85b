"""``engine.compile()``'s plan and its one-rank behaviour (the dist tests compare eager
and compiled training on two ranks: tests/dist/test_compile.py)."""

from __future__ import annotations

import logging

import pytest
import torch

import deepshard
from deepshard.errors import UsageError
from deepshard.runtime.compiled import CompiledModel, CompileRequest, plan_compile


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + x


class TwoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


def test_plan_zero3_units_but_the_root():
    plan = plan_compile(TwoBlocks(), ["", "blocks.0", "blocks.1"])
    assert not plan.whole and plan.regions == ("blocks.0", "blocks.1")
    # only the root unit: gathered at the model's entry
    assert plan_compile(TwoBlocks(), [""]).whole


def test_plan_repeated_blocks_else_the_whole_model():
    assert plan_compile(TwoBlocks(), None).regions == ("blocks.0", "blocks.1")
    single = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())  # nothing repeated
    assert plan_compile(single, None).whole
    assert plan_compile(torch.nn.Linear(2, 2), None).whole


def _engine(stage: int = 0, **config):
    model = TwoBlocks()
    engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **config})
    return engine


def test_regions_share_one_graph_and_hooks_stay_outside(one_rank_group):
    model = TwoBlocks()
    calls = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, args: calls.append(m))
    compiled = CompiledModel(model, plan_compile(model, None), CompileRequest(backend="eager"))
    compiled.apply()
    # an input that requires grad, like a block's behind an embedding: the same guards
    model(torch.ones(1, 4, requires_grad=True)).backward()
    assert calls == list(model.blocks)  # the hooks ran, eagerly, once per block
    assert compiled.graphs == 1 and compiled.graph_breaks == 0


def test_compile_twice_is_a_no_op_and_a_schedule_is_refused(one_rank_group):
    engine = _engine()
    assert not engine.is_compiled
    engine.compile(backend="eager")
    first = engine._compiled
    engine.compile(backend="inductor")
    assert engine.is_compiled and engine._compiled is first
    with pytest.raises(UsageError, match="schedule") as err:
        _engine().compile(schedule=[(0, "z3")])
    assert err.value.where == "engine.compile"


def test_config_section_compiles_at_initialize_and_reports_first_step(one_rank_group, caplog):
    engine = _engine(compile={"enabled": True, "backend": "eager"})
    assert engine.is_compiled and engine._compiled.request.backend == "eager"
    with caplog.at_level(logging.INFO, logger="deepshard"):
        engine.backward(engine(torch.ones(1, 4)))
        engine.step()
    assert [r.getMessage() for r in caplog.records
            if "the first step took" in r.getMessage()], caplog.text
    assert not _engine(compile={"disable": True}).is_compiled


def test_a_deepcopy_of_a_compiled_model_runs_its_own_weights(one_rank_group):
    import copy

    model = TwoBlocks()
    CompiledModel(model, plan_compile(model, None), CompileRequest(backend="eager")).apply()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = torch.ones(1, 4)
    with torch.no_grad():
        assert float(twin(x)) == pytest.approx(4.0)  # tanh(0) + x, twice: its zero weights
        assert float(model(x)) != pytest.approx(4.0)
