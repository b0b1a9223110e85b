"""bf16 / fp16 training casts the model's floating-point parameters only: buffers keep
their dtype, as DeepSpeed 0.19.8's engine keeps them (``_cast_module_mixed_precision``).
Casting an fp32 buffer too (what ``module.bfloat16()`` does, and deepshard did before)
changes the math silently: the DeepSpeed bf16 fixtures continued 1e-4 apart from
DeepSpeed's own run through their fp32 ``offset`` buffer, and bit for bit since."""

from __future__ import annotations

import pytest
import torch


class WithBuffers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.linspace(0.1, 1.0, 4))
        self.register_buffer("positions", torch.arange(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.inv_freq


@pytest.mark.parametrize("section", ["bf16", "fp16"])
def test_parameters_cast_buffers_kept(section, one_rank_group):
    import deepshard

    model = WithBuffers()
    cfg = {"train_batch_size": 1, section: {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    want = torch.bfloat16 if section == "bf16" else torch.float16
    assert {p.dtype for p in engine.module.parameters()} == {want}
    assert engine.module.inv_freq.dtype == torch.float32
    assert engine.module.positions.dtype == torch.int64
