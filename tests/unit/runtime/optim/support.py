"""What the optimizer tests share: a small model, its backward, and a per-tensor LAMB reference.

The LAMB reference follows ``lamb_cuda_kernel_part1/3`` in DeepSpeed's
``csrc/lamb/fused_lamb_cuda_kernel.cu`` and ``FusedLamb.step``'s clipping, one tensor and one
formula at a time, with no ``_foreach`` ops.
"""

from __future__ import annotations

import math

import torch


def small_model(dtype=torch.float64, seed=0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model[2].bias.data.zero_()  # ||p|| = 0: the trust ratio must fall back to 1
    return model.to(dtype)


def backward(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    x = torch.randn(8, 6, generator=gen, dtype=torch.float64).to(dtype)
    model.zero_grad()
    (model(x).square().sum() * 3).backward()


class ReferenceLamb:
    """DeepSpeed FusedLamb, one tensor and one step at a time, in the parameters' dtype."""

    def __init__(self, groups, **hp):
        self.groups = [{**hp, **g} for g in groups]
        self.state = {}

    @torch.no_grad()
    def step(self):
        for g in self.groups:
            params = [p for p in g["params"] if p.grad is not None]
            divisor = 1.0
            if g["max_grad_norm"] > 0:
                norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
                clip = (norm + 1e-6) / g["max_grad_norm"]
                divisor = clip if clip > 1 else 1.0
            b1, b2 = g["betas"]
            for p in params:
                st = self.state.setdefault(p, {"step": 0, "m": 0.0, "v": 0.0})
                st["step"] += 1
                grad = p.grad / divisor
                st["m"] = b1 * st["m"] + (1 - b1) * grad
                st["v"] = b2 * st["v"] + (1 - b2) * grad * grad
                if g["eps_inside_sqrt"]:
                    denom = torch.sqrt(st["v"] + g["eps"])
                else:
                    denom = torch.sqrt(st["v"]) + g["eps"]
                update = st["m"] / denom + g["weight_decay"] * p
                w, u = float(p.norm()), float(update.norm())
                coeff = 1.0
                if w != 0 and u != 0:
                    coeff = w / u
                    if coeff > g["max_coeff"]:
                        coeff = g["max_coeff"]
                    if coeff < g["min_coeff"]:
                        coeff = g["min_coeff"]
                step_size = g["lr"]
                if g["bias_correction"]:
                    t = st["step"]
                    step_size = g["lr"] * math.sqrt(1 - b2**t) / (1 - b1**t)
                p.sub_(step_size * coeff * update)


LAMB_DEFAULTS = {
    "lr": 1e-3,
    "bias_correction": True,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "eps_inside_sqrt": False,
    "weight_decay": 0.0,
    "max_grad_norm": 0.0,
    "max_coeff": 10.0,
    "min_coeff": 0.01,
}


def groups_of(model: torch.nn.Module) -> list[dict]:
    """Two groups with different lrs: weights and biases."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "lr": 0.003}]
