"""The LAMBs, all with DeepSpeed ``FusedLamb``'s exact update: :class:`Lamb` on any device
with ``torch._foreach`` ops, :class:`KernelLamb` on deepshard's CUDA kernel, and
:class:`FusedLamb`, DeepSpeed's constructor over :class:`KernelLamb`.

DeepSpeed's LAMB is a CUDA kernel (``csrc/lamb/fused_lamb_cuda_kernel.cu``); a config naming
``LAMB`` must train the same way here, on CPU as on GPU. The kernel's update differs from the
paper's in where the bias correction goes, which changes the trust ratio; see :class:`Lamb`.
The math is :func:`deepshard.kernels.lamb.lamb_reference` (with its clipping, step size and
argument checks), the one statement of it that the CUDA kernel is also tested against; this
module adds the optimizers around it: param groups, per-parameter state, buckets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from deepshard.kernels.lamb import (
    LOW_PRECISION,
    by_device_and_dtype,
    check_hyperparameters,
    clip_divisor,
    device_clip_divisor,
    fused_lamb_step,
    lamb_reference,
)
from deepshard.runtime.optim.adam import moment_columns
from deepshard.runtime.optim.base import StepOptimizer

__all__ = ["FusedLamb", "KernelLamb", "Lamb"]


class LambBase(StepOptimizer):
    """What :class:`Lamb` and :class:`KernelLamb` share: DeepSpeed's ``FusedLamb``
    constructor (checked hyperparameters as the param groups' defaults) and the opening of
    each step (the parameters with a gradient, per group; sparse ones refused)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        defaults = check_hyperparameters(
            lr, bias_correction, betas, eps, eps_inside_sqrt, weight_decay, max_grad_norm,
            max_coeff, min_coeff, amsgrad
        )
        super().__init__(params, defaults)

    def _groups_with_grads(self) -> Iterable[tuple[dict[str, Any], list[torch.Tensor]]]:
        """``(group, its parameters that have a gradient)`` for each group with any."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("LAMB does not support sparse gradients")
            yield group, params


class Lamb(LambBase):
    """LAMB (https://arxiv.org/abs/1904.00962) as DeepSpeed's ``FusedLamb`` computes it.

    For each parameter ``p`` with gradient ``g`` at step ``t`` (counted per parameter):

    * ``g = g / c`` where ``c = (||G|| + 1e-6) / max_grad_norm`` when ``max_grad_norm > 0``
      and ``c > 1``; ``||G||`` is the 2-norm over all gradients of the param group (the
      gradients themselves are left untouched);
    * ``m = beta1 m + (1 - beta1) g``, ``v = beta2 v + (1 - beta2) g^2``;
    * ``u = m / (sqrt(v) + eps) + weight_decay * p`` (``sqrt(v + eps)`` with
      ``eps_inside_sqrt``), from the moments *without* bias correction;
    * ``r = ||p|| / ||u||`` clamped to ``[min_coeff, max_coeff]``, or 1 when either norm is 0;
    * ``p = p - lr * sqrt(1 - beta2^t) / (1 - beta1^t) * r * u`` (just ``lr * r * u`` without
      ``bias_correction``).

    So the bias correction scales the whole step, weight decay included, and the trust ratio
    is measured on the uncorrected update; the paper's form (``m̂ / (sqrt(v̂) + eps)``) gives
    different steps early in training. State per parameter: ``step`` (int), ``exp_avg``,
    ``exp_avg_sq``, as in DeepSpeed, so checkpoints carry over. fp16/bf16 parameters keep
    fp32 moments and are updated in fp32 (in fp16, ``eps`` and small ``v`` would flush to 0).

    Args:
        params: tensors, or param-group dicts, to optimise.
        lr: learning rate.
        bias_correction: whether to apply Adam's bias correction to the step size.
        betas: decay rates of the first and second moments.
        eps: added to the denominator.
        eps_inside_sqrt: add ``eps`` under the square root instead of after it.
        weight_decay: decay added to the update before the trust ratio.
        max_grad_norm: clip each param group's gradient norm to this; 0 disables clipping.
        max_coeff: upper bound of the trust ratio.
        min_coeff: lower bound of the trust ratio.
        amsgrad: not supported; ``True`` raises ``ValueError``.
    """

    def _take_step(self) -> None:
        """Apply one LAMB update to every parameter that has a gradient."""
        for group, params in self._groups_with_grads():
            grad_divisor = clip_divisor([p.grad for p in params], group["max_grad_norm"])
            for bucket in by_device_and_dtype(params):
                self._update(bucket, group, grad_divisor)

    def _state(self, params: list[torch.Tensor]
               ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """Each parameter's moments (fp32 for fp16/bf16 parameters) and its advanced step."""
        exp_avgs: list[torch.Tensor] = []
        exp_avg_sqs: list[torch.Tensor] = []
        steps: list[int] = []
        for p in params:
            state = self.state[p]
            dtype = torch.float32 if p.dtype in LOW_PRECISION else p.dtype
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
            elif state["exp_avg"].dtype != dtype:  # torch's load_state_dict casts to p.dtype
                state["exp_avg"] = state["exp_avg"].to(dtype)
                state["exp_avg_sq"] = state["exp_avg_sq"].to(dtype)
            state["step"] += 1
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        return exp_avgs, exp_avg_sqs, steps

    def _update(self, params: list[torch.Tensor], group: dict[str, Any], divisor: float) -> None:
        """One step for same-device, same-dtype ``params``."""
        beta1, beta2 = group["betas"]
        exp_avgs, exp_avg_sqs, steps = self._state(params)
        lamb_reference(
            params,
            [p.grad for p in params],
            exp_avgs,
            exp_avg_sqs,
            step=steps,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"],
            eps_inside_sqrt=group["eps_inside_sqrt"],
            max_coeff=group["max_coeff"],
            min_coeff=group["min_coeff"],
            grad_divisor=divisor,
        )


class KernelLamb(LambBase):
    """LAMB on deepshard's CUDA kernel (``cuda/lamb.cu``, through
    :func:`~deepshard.kernels.lamb.fused_lamb_step`), or
    :func:`~deepshard.kernels.lamb.lamb_reference` where the kernel cannot run: the update
    of :class:`Lamb`, per param group. A config's ``LAMB`` builds it on GPUs with CuPy.

    Until moved here it was ``deepshard.kernels.lamb.FusedLamb``; DeepSpeed's ``FusedLamb``
    is :class:`FusedLamb`, this class under DeepSpeed's ``amsgrad`` refusal.

    Arguments and state (``step`` int, fp32 ``exp_avg`` and ``exp_avg_sq``) are those of
    :class:`Lamb`, so checkpoints move between the two. With ``max_grad_norm > 0`` each
    group's gradients are clipped to it as one vector; the divisor stays on the device. One
    launch sequence per (device, dtype, step) bucket.
    """

    def _take_step(self) -> None:
        """Apply one LAMB update to every parameter that has a gradient."""
        for group, params in self._groups_with_grads():
            divisor = device_clip_divisor([p.grad for p in params], group["max_grad_norm"])
            beta1, beta2 = group["betas"]
            for (device, _, step), (ps, gs, ms, vs) in moment_columns(self.state,
                                                                      params).items():
                fused_lamb_step(ps, gs, ms, vs, step=step, lr=group["lr"], beta1=beta1,
                                beta2=beta2, eps=group["eps"],
                                weight_decay=group["weight_decay"],
                                bias_correction=group["bias_correction"],
                                eps_inside_sqrt=group["eps_inside_sqrt"],
                                max_coeff=group["max_coeff"], min_coeff=group["min_coeff"],
                                grad_divisor=divisor.to(device))


class FusedLamb(KernelLamb):
    """DeepSpeed's ``FusedLamb`` (``deepspeed.ops.lamb.FusedLamb``) with its constructor:
    :class:`KernelLamb`, the CUDA kernel when every tensor of a step is on a GPU and CuPy is
    installed, else :func:`~deepshard.kernels.lamb.lamb_reference`, the update :class:`Lamb`
    (what a config's ``LAMB`` builds on the CPU) also runs; the state (``step``,
    ``exp_avg``, ``exp_avg_sq``) is the same.

    ``amsgrad=True`` raises ``RuntimeError``, and a bad hyperparameter ``ValueError``.
    DeepSpeed's ``get_lamb_coeffs()`` (the trust ratios of every step so far) is not kept.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False) -> None:
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                         max_grad_norm=max_grad_norm, max_coeff=max_coeff,
                         min_coeff=min_coeff)
