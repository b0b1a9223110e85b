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


# -- the pipeline and MoE fixtures (``make_parallel_fixtures.py``) --------------------------
PIPE_MICRO = 4  # 2 micro-batches of 4 samples per step and pipeline
EXPERTS = 4


def pipe_layers() -> list[torch.nn.Module]:
    """The pipeline fixture's layers: 8 → 16 → 16 → 4 with ReLUs between (5 layers, the
    parameters under their global index: ``0.weight``, ``2.bias``...)."""
    return [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
            torch.nn.Linear(16, 4)]


def pipe_config(stage: int) -> dict:
    """The pipeline fixture's config: :func:`config` with 2 micro-batches per step."""
    cfg = config(stage, False)
    cfg["train_micro_batch_size_per_gpu"] = PIPE_MICRO
    cfg["gradient_accumulation_steps"] = GLOBAL_BATCH // PIPE_MICRO
    return cfg


def pipe_batches(step: int, dp_rank: int, dp_world: int) -> list:
    """The micro-batches one pipeline (data-parallel replica ``dp_rank``) trains on at
    ``step``: its part of the global batch, cut into micro-batches of ``PIPE_MICRO``."""
    x, y = batch(step, dp_rank, dp_world)
    return [(x[i:i + PIPE_MICRO], y[i:i + PIPE_MICRO]) for i in range(0, len(x), PIPE_MICRO)]


class MoENet(torch.nn.Module):
    """8 → MoE(8, 4 experts of 8 → 16 → 8, top-1) → 4, built with ``moe_cls`` (DeepSpeed's
    ``MoE`` or deepshard's, same signature). Dropless (no token is dropped at any world
    size) and deterministic routing."""

    def __init__(self, moe_cls: type, ep_size: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                     torch.nn.Linear(16, 8))
        self.moe = moe_cls(8, expert, num_experts=EXPERTS, ep_size=ep_size, k=1,
                           min_capacity=2, drop_tokens=False, use_rts=False)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        return self.out(y), l_aux


def moe_model(moe_cls: type, ep_size: int, ep_rank: int) -> MoENet:
    """The MoE fixture's model at ``ep_size`` for expert-parallel rank ``ep_rank``: seed 0,
    every expert made different (by its global id)."""
    torch.manual_seed(0)
    net = MoENet(moe_cls, ep_size)
    local = EXPERTS // ep_size
    with torch.no_grad():
        for i, expert in enumerate(net.moe.deepspeed_moe.experts.deepspeed_experts):
            g = torch.Generator().manual_seed(ep_rank * local + i)
            for p in expert.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return net


def moe_train_step(engine, step: int, rank: int, world: int) -> float:
    """:func:`train_step` for :class:`MoENet`. The load-balancing loss is left out: it is
    computed over each rank's tokens, so with it the continuation would depend on how the
    batch is split over ranks; without it it does not (nor on ``ep_size``)."""
    x, y = batch(step, rank, world)
    out, _ = engine(x)
    loss = torch.nn.functional.mse_loss(out, y)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())
