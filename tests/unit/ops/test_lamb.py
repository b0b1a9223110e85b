"""``deepspeed.ops.lamb.FusedLamb``: DeepSpeed's constructor over deepshard's LAMB, step for
step equal to :func:`deepshard.kernels.lamb.lamb_reference` and to the runtime's ``Lamb``."""

from __future__ import annotations

import pytest
import torch

from deepshard.kernels.lamb import clip_divisor, lamb_reference
from deepshard.runtime.optim.lamb import FusedLamb, Lamb

HP = dict(lr=2e-2, betas=(0.85, 0.99), eps=1e-6, weight_decay=0.05, max_grad_norm=1.0,
          max_coeff=5.0, min_coeff=0.02)


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 4, generator=gen)),
            torch.nn.Parameter(torch.randn(9, generator=gen))]


def grads(step: int, ps) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) * 2 for p in ps]


@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
def test_steps_equal_lamb_reference_and_the_runtime_lamb(eps_inside_sqrt):
    ours, runtime = params(), params()
    ref = [p.detach().clone() for p in params()]
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    opt = FusedLamb(ours, eps_inside_sqrt=eps_inside_sqrt, **HP)
    other = Lamb(runtime, eps_inside_sqrt=eps_inside_sqrt, **HP)
    for step in range(1, 6):
        g = grads(step, ours)
        for p, q, gg in zip(ours, runtime, g, strict=True):
            p.grad, q.grad = gg.clone(), gg.clone()
        opt.step()
        other.step()
        lamb_reference(ref, g, m, v, step=step, lr=HP["lr"], beta1=0.85, beta2=0.99,
                       eps=HP["eps"], weight_decay=HP["weight_decay"],
                       eps_inside_sqrt=eps_inside_sqrt, max_coeff=5.0, min_coeff=0.02,
                       grad_divisor=clip_divisor(g, HP["max_grad_norm"]))
    for a, b, c in zip(ours, runtime, ref, strict=True):
        torch.testing.assert_close(a.detach(), c, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert opt.state[ours[0]]["step"] == 5


def test_deepspeeds_signature_and_refusals():
    opt = FusedLamb(params())
    assert {k: opt.defaults[k] for k in ("lr", "bias_correction", "betas", "eps",
                                         "eps_inside_sqrt", "weight_decay", "max_grad_norm",
                                         "max_coeff", "min_coeff")} == {
        "lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
        "eps_inside_sqrt": False, "weight_decay": 0.0, "max_grad_norm": 0.0,
        "max_coeff": 10.0, "min_coeff": 0.01}
    with pytest.raises(RuntimeError, match="FusedLamb does not support the AMSGrad variant"):
        FusedLamb(params(), amsgrad=True)
    with pytest.raises(ValueError, match="lr"):
        FusedLamb(params(), lr=-1.0)
