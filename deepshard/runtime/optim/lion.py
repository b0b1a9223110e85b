"""DeepSpeed's Lions: ``deepspeed.ops.lion.DeepSpeedCPULion`` (a C++ loop over CPU tensors)
and ``deepspeed.ops.lion.FusedLion`` (a CUDA multi-tensor kernel), in torch ops.

A config's ``Lion`` builds the CPU one under ZeRO-Offload and the fused one otherwise
(``build.py``). Here both are ``torch._foreach`` passes that run on any device with nothing
to build. Per element, as DeepSpeed 0.19.8 computes it (``csrc/lion/cpu_lion_impl.cpp``
``Step_1``, ``csrc/includes/cpu_lion.h`` ``Step_AVX``, ``csrc/lion/multi_tensor_lion.cu``
``LionFunctor``)::

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * s(c)   # decoupled decay
    m = beta2 * m + (1 - beta2) * g               # state "exp_avg"

where ``s(c)`` is never 0, unlike ``sign``: the CPU Lion takes the sign *bit* of ``c``
(``-copysign(lr, c)``: ``+0`` steps down, ``-0`` up), the fused kernel ``c > 0`` (``0`` and
NaN step up). Each class keeps its DeepSpeed original's rule. The coefficients (``1 - beta``,
``1 - lr * weight_decay``) are computed in fp32, as both kernels compute them; in fp64 they
would differ by up to 1e-5 relative (``1 - 0.999``), which shows in the moments.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Literal

import torch

from deepshard.kernels.lamb import by_device_and_dtype
from deepshard.runtime.optim.base import StepOptimizer, in_fp32, write_back

__all__ = ["DeepSpeedCPULion", "FusedLion", "LionBase", "SignRule", "lion_update"]

SignRule = Literal["signbit", "positive"]
"""How a Lion turns ``c`` into a step of ``-lr`` or ``+lr``: ``"signbit"`` steps down unless
``c``'s sign bit is set (DeepSpeedCPULion); ``"positive"`` steps down only where ``c > 0``
(FusedLion)."""


class LionBase(StepOptimizer):
    """What the two Lions share: DeepSpeed's hyperparameters as the param groups' defaults
    (``lr``, ``betas``, ``weight_decay``), checked, and a step that updates each group's
    parameters with :func:`lion_update`, one pass per (device, dtype). Subclasses set the
    name, the sign rule and how a parameter's state starts (:meth:`_new_state`)."""

    what: ClassVar[str] = "Lion"
    sign_rule: ClassVar[SignRule] = "positive"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0) -> None:
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"{self.what}: lr and weight_decay must be >= 0, got {lr}, "
                             f"{weight_decay}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{self.what}: betas must be two values in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _take_step(self) -> None:
        """One Lion step for every parameter with a gradient."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise NotImplementedError(f"{self.what} does not support sparse gradients")
            for p in params:
                state = self.state[p]
                if not state:
                    state.update(self._new_state(p, group))
                state["step"] += 1
            beta1, beta2 = group["betas"]
            for bucket in by_device_and_dtype(params):
                lion_update(bucket, [p.grad for p in bucket],
                            [self.state[p]["exp_avg"] for p in bucket], lr=group["lr"],
                            beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                            sign_rule=self.sign_rule)

    def _new_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """The state of a parameter's first step, before ``step`` is counted."""
        raise NotImplementedError(f"{type(self).__name__} does not define _new_state()")


class DeepSpeedCPULion(LionBase):
    """DeepSpeed's ``DeepSpeedCPULion`` with its constructor, numerically DeepSpeed's C++
    Lion (see the module docstring: the sign-bit rule), on any device.

    State per parameter: ``step`` (an int, counted but unused by the update) and
    ``exp_avg``, fp32 unless ``fp32_optimizer_states`` is false (then the parameter's
    dtype); fp16/bf16 parameters are updated in fp32 and rounded once. DeepSpeed also
    allocates an ``exp_avg_sq`` that nothing reads; it is not kept here (a DeepSpeed
    checkpoint that has it loads, and its value is ignored as DeepSpeed ignores it).
    Parameters need not be on the CPU (DeepSpeed asserts they are).

    Args:
        model_params: tensors, or param-group dicts, to optimise.
        lr: learning rate.
        betas: the interpolation (beta1) and momentum (beta2) coefficients.
        weight_decay: decoupled decay (``p *= 1 - lr * weight_decay``).
        fp32_optimizer_states: keep ``exp_avg`` in fp32 whatever the parameter dtype.
    """

    what = "DeepSpeedCPULion"
    sign_rule = "signbit"

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0,
                 fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states

    def _new_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
        return {"step": 0, "exp_avg": torch.zeros_like(p, dtype=dtype,
                                                       memory_format=torch.preserve_format)}


class FusedLion(LionBase):
    """DeepSpeed's ``FusedLion`` with its constructor, numerically DeepSpeed's CUDA kernel
    (see the module docstring: the ``c > 0`` rule), on any device.

    State per parameter, as DeepSpeed's: ``step`` (an int, started from the group's
    ``step`` where an old checkpoint has one) and ``exp_avg`` in the parameter's dtype;
    fp16/bf16 are computed in fp32 and rounded once, as the kernel does. Every parameter's
    ``step`` counts its steps (DeepSpeed's increments only the last parameter's of each
    dtype; the update reads none of them). fp64 parameters are stepped too (DeepSpeed's
    kernel takes fp16, bf16 and fp32 only); sparse gradients raise ``NotImplementedError``.

    Args:
        params: tensors, or param-group dicts, to optimise.
        lr: learning rate.
        betas: the interpolation (beta1) and momentum (beta2) coefficients.
        weight_decay: decoupled decay (``p *= 1 - lr * weight_decay``).
        set_grad_none: ``zero_grad()`` sets gradients to ``None`` (else zeros them).
    """

    what = "FusedLion"
    sign_rule = "positive"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
                 set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients: to ``None`` unless ``set_grad_none`` was false (or
        ``set_to_none`` says otherwise)."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def _new_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {"step": group.get("step", 0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format)}


def lion_update(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                exp_avgs: Sequence[torch.Tensor], *, lr: float, beta1: float, beta2: float,
                weight_decay: float, sign_rule: SignRule) -> None:
    """One DeepSpeed Lion step on same-device tensors, in place (the grads untouched).

    The coefficients are rounded to fp32 as DeepSpeed's kernels compute them; fp16/bf16
    tensors are computed in fp32 and written back once. ``weight_decay`` must be >= 0.
    """
    k = _fp32_coefficients(lr, beta1, beta2, weight_decay)
    ps, gs, ms = in_fp32(params), in_fp32(grads), in_fp32(exp_avgs)
    steps = torch._foreach_mul(ms, k["beta1"])
    torch._foreach_add_(steps, gs, alpha=k["one_minus_beta1"])
    for c in steps:  # c becomes the step -lr or +lr, in place
        up = torch.signbit(c) if sign_rule == "signbit" else torch.logical_not(c > 0)
        c.fill_(-k["lr"]).masked_fill_(up, k["lr"])
    if weight_decay > 0:
        torch._foreach_mul_(ps, k["after_decay"])
    torch._foreach_add_(ps, steps)
    torch._foreach_mul_(ms, k["beta2"])
    torch._foreach_add_(ms, gs, alpha=k["one_minus_beta2"])
    write_back(params, ps)
    write_back(exp_avgs, ms)


def _fp32_coefficients(lr: float, beta1: float, beta2: float,
                       weight_decay: float) -> dict[str, float]:
    """The scalars of the update as DeepSpeed's kernels compute them: in fp32."""
    lr32, b1, b2, wd = (torch.tensor(x, dtype=torch.float32)
                        for x in (lr, beta1, beta2, weight_decay))
    return {"lr": float(lr32), "beta1": float(b1), "beta2": float(b2),
            "one_minus_beta1": float(1 - b1), "one_minus_beta2": float(1 - b2),
            "after_decay": float(1 - lr32 * wd)}
