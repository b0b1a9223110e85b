"""``StepOptimizer``: every deepshard optimizer steps through its one ``step(closure)``: the
closure runs with gradients on and its loss comes back, the update runs with gradients off,
and torch's step hooks run once per step."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

from deepshard.runtime.optim import (
    DeepSpeedCPUAdam,
    FusedAdam,
    FusedLamb,
    KernelAdam,
    KernelLamb,
    Lamb,
    StepOptimizer,
    TorchAdam,
)
from deepshard.runtime.optim.onebit import OneBitAdam, OneBitLamb, ZeroOneAdam

MAKERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "Lamb": lambda ps: Lamb(ps, lr=1e-2),
    "KernelLamb": lambda ps: KernelLamb(ps, lr=1e-2),
    "FusedLamb": lambda ps: FusedLamb(ps, lr=1e-2, max_grad_norm=1.0),
    "TorchAdam": lambda ps: TorchAdam(ps, lr=1e-2),
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, bias_correction=False),
    "DeepSpeedCPUAdam": lambda ps: DeepSpeedCPUAdam(ps, lr=1e-2),
    "KernelAdam": lambda ps: KernelAdam(ps, lr=1e-2),
    "OneBitAdam": lambda ps: OneBitAdam(ps, lr=1e-2, freeze_step=1),
    "OneBitLamb": lambda ps: OneBitLamb(ps, lr=1e-2, freeze_step=2),
    "ZeroOneAdam": lambda ps: ZeroOneAdam(ps, lr=1e-2),
}
CLASSES = [Lamb, KernelLamb, FusedLamb, TorchAdam, FusedAdam, DeepSpeedCPUAdam, KernelAdam,
           OneBitAdam, OneBitLamb, ZeroOneAdam]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_optimizer_steps_through_the_shared_skeleton(cls):
    assert issubclass(cls, StepOptimizer)
    # torch wraps each class's step in its hook runner; underneath is the one skeleton
    assert inspect.unwrap(cls.step) is inspect.unwrap(StepOptimizer.step)
    assert "_take_step" in vars(cls) or cls.__base__ in CLASSES


@pytest.mark.parametrize("name", list(MAKERS))
def test_step_runs_the_closure_with_grad_then_updates_without(name, one_rank_group):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    opt = MAKERS[name](net.parameters())
    hooks = {"pre": 0, "post": 0}
    opt.register_step_pre_hook(lambda *_: hooks.__setitem__("pre", hooks["pre"] + 1))
    opt.register_step_post_hook(lambda *_: hooks.__setitem__("post", hooks["post"] + 1))
    x = torch.randn(5, 4)
    losses = []

    def closure() -> torch.Tensor:
        assert torch.is_grad_enabled()
        opt.zero_grad()
        loss = net(x).square().sum()
        loss.backward()
        losses.append(loss)
        return loss

    for step in range(1, 4):
        before = [p.detach().clone() for p in net.parameters()]
        with torch.no_grad():  # the closure still gets gradients
            returned = opt.step(closure)
        assert returned is losses[-1] and len(losses) == step
        assert hooks == {"pre": step, "post": step}
        assert any(not torch.equal(a, p) for a, p in zip(before, net.parameters(), strict=True))
        assert all(p.grad_fn is None for p in net.parameters())
    assert opt.step() is None  # no closure: None, as torch's optimizers


def test_an_optimizer_without_an_update_says_so():
    class Bare(StepOptimizer):
        pass

    opt = Bare([torch.nn.Parameter(torch.zeros(2))], {"lr": 0.1})
    with pytest.raises(NotImplementedError, match="Bare does not define _take_step"):
        opt.step()
