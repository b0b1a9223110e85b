"""The model, data and config of the DeepSpeed checkpoint fixtures, shared by the script
that writes them (with DeepSpeed) and the tests that load them (with deepshard): a tiny
MLP with a frozen layer and a buffer, Adam with weight decay, a warm-up schedule, and one
global batch of 8 samples per step split evenly over however many ranks train."""

from __future__ import annotations

import torch

SAVE_AT = 2
CONTINUE = 3
GLOBAL_BATCH = 8


class Net(torch.nn.Module):
    """8 → 16 → 4 with a frozen embedding-like input scale and a constant buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Linear(8, 8, bias=False)
        self.scale.weight.requires_grad_(False)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.register_buffer("offset", torch.linspace(-1, 1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.scale(x)))) + self.offset


def config(stage: int, bf16: bool) -> dict:
    """The DeepSpeed config of one case (also accepted by deepshard as it is)."""
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01,
                                                   "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                     "warmup_max_lr": 0.02,
                                                     "warmup_num_steps": 4,
                                                     "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 1000,
    }


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the global batch of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = torch.randn(GLOBAL_BATCH, 4, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def train_step(engine, step: int, rank: int, world: int) -> float:
    """One optimizer step on this rank's part of ``step``'s batch; the local loss."""
    x, y = batch(step, rank, world)
    dtype = next(p for p in engine.module.parameters()).dtype
    out = engine(x.to(dtype))
    loss = torch.nn.functional.mse_loss(out.float(), y)
    engine.backward(loss)
    engine.step()
    return float(loss)
