"""DeepSpeed's CPU Adagrad (``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``) in torch ops.

DeepSpeed's is a C++ loop (AVX where the CPU has it) over CPU tensors, compiled the first time
it is used; a config's ``Adagrad`` builds it under ZeRO-Offload (``build.py``). This is the
same update in ``torch._foreach`` ops: nothing to build, and it steps tensors on any device.
Per element, as DeepSpeed 0.19.8 computes it (``csrc/adagrad/cpu_adagrad.cpp``
``Step_1``, ``csrc/includes/cpu_adagrad.h`` ``Step_AVX``)::

    g = g + weight_decay * p          # L2 decay, only when weight_decay > 0
    v = v + g * g                     # state "exp_avg_sq"
    p = p - lr * g / (sqrt(v) + eps)

That is torch's ``Adagrad`` with ``lr_decay=0`` and ``initial_accumulator_value=0`` (eps is
added after the square root in both), under DeepSpeed's state: ``step`` (an int, counted but
unused by the update) and ``exp_avg_sq``, so checkpoints move between DeepSpeed and here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from deepshard.kernels.lamb import by_device_and_dtype
from deepshard.runtime.optim.base import StepOptimizer, in_fp32, write_back

__all__ = ["DeepSpeedCPUAdagrad", "adagrad_update"]

AMSGRAD_REFUSED = ("DeepSpeedCPUAdagrad does not support the AMSGrad variant (DeepSpeed's "
                   "accepts amsgrad=True and ignores it). HINT: remove amsgrad")


class DeepSpeedCPUAdagrad(StepOptimizer):
    """DeepSpeed's ``DeepSpeedCPUAdagrad`` with its constructor, numerically DeepSpeed's
    C++ Adagrad (see the module docstring), on any device.

    fp16/bf16 parameters are updated in fp32 and rounded once, as DeepSpeed does; the
    accumulator is fp32 unless ``fp32_optimizer_states`` is false (then the parameter's
    dtype). Sparse gradients (``nn.Embedding(sparse=True)``) update only the rows they
    hold, weight decay included, as DeepSpeed's sparse path does.

    Differences from DeepSpeed, none in the numbers: parameters need not be on the CPU
    (DeepSpeed asserts they are); ``p.grad`` is left as it was (DeepSpeed's scalar tail loop
    overwrites part of it with the update); ``amsgrad=True``, which DeepSpeed accepts and
    ignores, raises ``RuntimeError``; a negative hyperparameter raises ``ValueError``.

    Args:
        model_params: tensors, or param-group dicts, to optimise.
        lr: learning rate.
        eps: added to the square root of the accumulator.
        weight_decay: L2 decay, added to the gradient.
        amsgrad: not supported; ``True`` raises ``RuntimeError``.
        fp32_optimizer_states: keep the accumulator in fp32 whatever the parameter dtype.
    """

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10,
                 weight_decay: float = 0, amsgrad: bool = False,
                 fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise RuntimeError(AMSGRAD_REFUSED)
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if value < 0:
                raise ValueError(f"DeepSpeedCPUAdagrad: {name} must be >= 0, got {value}")
        super().__init__(model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay,
                                            amsgrad=False))
        self.fp32_optimizer_states = fp32_optimizer_states

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, refusing a group that asks for ``amsgrad``."""
        if param_group.get("amsgrad", False):
            raise RuntimeError(AMSGRAD_REFUSED)
        super().add_param_group(param_group)

    def _take_step(self) -> None:
        """One Adagrad step for every parameter with a gradient: the dense ones of a group
        in one foreach pass per (device, dtype), the sparse ones row by row."""
        for group in self.param_groups:
            hp = dict(lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"])
            dense = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._advance(p)
                if p.grad.is_sparse:
                    self._step_sparse(p, **hp)
                else:
                    dense.append(p)
            for bucket in by_device_and_dtype(dense):
                adagrad_update(bucket, [p.grad for p in bucket],
                               [self.state[p]["exp_avg_sq"] for p in bucket], **hp)

    def _advance(self, p: torch.Tensor) -> None:
        """Create ``p``'s state (DeepSpeed's layout) if it has none, and count the step."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype,
                                                   memory_format=torch.preserve_format)
        state["step"] += 1

    def _step_sparse(self, p: torch.Tensor, *, lr: float, eps: float,
                     weight_decay: float) -> None:
        """The update of the entries (rows, for an embedding) a sparse gradient holds."""
        grad = p.grad.coalesce()
        index = tuple(grad.indices())
        exp_avg_sq = self.state[p]["exp_avg_sq"]
        rows, sums = p[index], exp_avg_sq[index]  # copies: advanced indexing
        adagrad_update([rows], [grad.values()], [sums], lr=lr, eps=eps,
                       weight_decay=weight_decay)
        p[index] = rows
        exp_avg_sq[index] = sums


def adagrad_update(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   exp_avg_sqs: Sequence[torch.Tensor], *, lr: float, eps: float,
                   weight_decay: float) -> None:
    """One DeepSpeed Adagrad step on same-device tensors, in place (the grads untouched).

    fp16/bf16 tensors are computed in fp32 and written back once, as DeepSpeed's kernel
    loads them into fp32 registers and stores the result.
    """
    ps, gs, vs = in_fp32(params), in_fp32(grads), in_fp32(exp_avg_sqs)
    if weight_decay > 0:
        gs = torch._foreach_add(gs, ps, alpha=weight_decay)
    torch._foreach_addcmul_(vs, gs, gs)
    denominators = torch._foreach_sqrt(vs)
    torch._foreach_add_(denominators, eps)
    torch._foreach_addcdiv_(ps, gs, denominators, value=-lr)
    write_back(params, ps)
    write_back(exp_avg_sqs, vs)
