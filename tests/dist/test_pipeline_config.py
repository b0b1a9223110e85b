"""The ``pipeline`` config section applied to a ``PipelineModule`` built before
``initialize`` read it. DeepSpeed 0.19.8 (2 stages on 2 ranks, 4 layers) applies both keys
in ``PipelineEngine.__init__``: a positive ``activation_checkpoint_interval`` replaces the
module's (1: 4 checkpoint calls on stage 0 and 8 on stage 1 over 2 batches of 2
micro-batches), ``use_reentrant: false`` swaps in its non-reentrant checkpoint; the losses
were the same with and without (0.91712, 0.41435)."""

from __future__ import annotations

import torch

import deepshard
from deepshard.runtime.parallel.pipe_module import LayerSpec, PipelineModule


def pipe(func=None) -> PipelineModule:
    torch.manual_seed(0)
    layers = [LayerSpec(torch.nn.Linear, 6, 6), LayerSpec(torch.nn.Tanh),
              LayerSpec(torch.nn.Linear, 6, 6), LayerSpec(torch.nn.Tanh)]
    return PipelineModule(layers, num_stages=1, stage_id=0,
                          loss_fn=torch.nn.MSELoss(), activation_checkpoint_func=func)


def train(one_process, section: dict, func=None) -> tuple[list[float], object]:
    config = {"train_batch_size": 4, "gradient_accumulation_steps": 2,
              "gradient_clipping": 0.0, "pipeline": section,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepshard.initialize(model=pipe(func), config=config)
    g = torch.Generator().manual_seed(1)
    data = iter([(torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g))
                 for _ in range(4)])
    losses = [float(engine.train_batch(data)) for _ in range(2)]
    return losses, engine


def test_the_config_s_checkpoint_interval_replaces_the_module_s(one_process):
    calls = []

    def spy(function, *args):
        calls.append(function)
        return function(*args)

    plain, _ = train(one_process, {})
    assert calls == []
    torch.distributed.destroy_process_group()
    checkpointed, engine = train(one_process, {"activation_checkpoint_interval": 1,
                                               "use_reentrant": False}, spy)
    assert engine.module.activation_checkpoint_interval == 1
    assert len(calls) == 2 * 2 * 2  # two Linear chunks per micro-batch, 2 x 2 micro-batches
    assert checkpointed == plain
