"""``deepshard.pipe`` and ``deepshard.runtime.pipe``: DeepSpeed's import paths resolve to the
runtime's pipeline classes, and the topology constructors lay ranks out as DeepSpeed's do."""

from __future__ import annotations

import itertools

import torch
from torch import nn

import deepshard.pipe
import deepshard.runtime.pipe
from deepshard.runtime.parallel import pipe_engine, pipe_module, topology
from deepshard.runtime.pipe import engine, module
from deepshard.runtime.pipe import topology as pipe_topology


def test_names_are_the_runtime_classes():
    for facade in (deepshard.pipe, deepshard.runtime.pipe, module):
        assert facade.PipelineModule is pipe_module.PipelineModule
        assert facade.LayerSpec is pipe_module.LayerSpec
        assert facade.TiedLayerSpec is pipe_module.TiedLayerSpec
    assert engine.PipelineEngine is pipe_engine.PipelineEngine
    assert pipe_topology.PipeModelDataParallelTopology is topology.PipeModelDataParallelTopology


def test_topologies_lay_ranks_out_as_deepspeeds():
    # DeepSpeed: axes ['pipe', 'data', 'model'], row-major, so model varies fastest
    topo = pipe_topology.PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    assert (topo.pipe, topo.data, topo.tensor) == (2, 3, 2)
    expected = [(p * 3 + d) * 2 + m for p, d, m in itertools.product(range(2), range(3), range(2))]
    assert [topo.rank(p, d, m) for p, d, m in
            itertools.product(range(2), range(3), range(2))] == expected == list(range(12))
    two = pipe_topology.PipeDataParallelTopology(num_pp=2, num_dp=4)
    assert (two.pipe, two.data, two.tensor) == (2, 4, 1)
    assert two.rank(1, 2) == 6  # pipe-major, data fastest: DeepSpeed's axes ['pipe', 'data']


def test_a_pipeline_module_from_the_facade_runs_its_stage():
    torch.manual_seed(0)
    pipe = deepshard.pipe.PipelineModule(
        layers=[deepshard.pipe.LayerSpec(nn.Linear, 4, 6), nn.ReLU(),
                deepshard.pipe.LayerSpec(nn.Linear, 6, 2)],
        num_stages=2, stage_id=0, partition_method="uniform")
    assert pipe.parts == (0, 2, 3)  # stage 0 holds the first Linear and the ReLU
    x = torch.randn(3, 4)
    first = pipe.forward_funcs[0]
    torch.testing.assert_close(pipe(x), torch.relu(first(x)))
