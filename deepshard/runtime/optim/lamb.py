"""LAMB with DeepSpeed ``FusedLamb``'s exact update, on any device, with ``torch._foreach`` ops.

DeepSpeed's LAMB is a CUDA kernel (``csrc/lamb/fused_lamb_cuda_kernel.cu``); a config naming
``LAMB`` must train the same way here, on CPU as on GPU. The kernel's update differs from the
paper's in where the bias correction goes, which changes the trust ratio; see :class:`Lamb`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

# Added to the gradient norm before comparing it with max_grad_norm, as DeepSpeed does.
_CLIP_EPS = 1e-6
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class Lamb(torch.optim.Optimizer):
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
        if amsgrad:
            raise ValueError("LAMB does not support amsgrad")
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if max_grad_norm < 0:
            raise ValueError(
                f"max_grad_norm must be >= 0 (0 disables clipping), got {max_grad_norm}"
            )
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must be in [0, 1), got {tuple(betas)}")
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": tuple(betas),
            "eps": eps,
            "eps_inside_sqrt": eps_inside_sqrt,
            "weight_decay": weight_decay,
            "max_grad_norm": max_grad_norm,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply one LAMB update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("LAMB does not support sparse gradients")
            grad_divisor = self._clip_divisor(params, group["max_grad_norm"])
            for bucket in _by_device_and_dtype(params):
                self._update(bucket, group, grad_divisor)
        return loss

    @staticmethod
    def _clip_divisor(params: list[torch.Tensor], max_grad_norm: float) -> float:
        """What to divide the group's gradients by so their norm is at most ``max_grad_norm``."""
        if max_grad_norm <= 0:
            return 1.0
        squares = 0.0
        for grads in _by_device_and_dtype([p.grad for p in params]):
            squares += float(torch.stack(_norms(grads)).square().sum())
        clip = (math.sqrt(squares) + _CLIP_EPS) / max_grad_norm
        return clip if clip > 1 else 1.0

    def _state(self, params: list[torch.Tensor], group: dict[str, Any]) -> tuple[list, list, list]:
        """Each parameter's moments (fp32 for fp16/bf16 parameters) and this step's step size."""
        exp_avgs, exp_avg_sqs, step_sizes = [], [], []
        for p in params:
            state = self.state[p]
            dtype = torch.float32 if p.dtype in _LOW_PRECISION else p.dtype
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
            step_sizes.append(_step_size(group, state["step"]))
        return exp_avgs, exp_avg_sqs, step_sizes

    def _update(self, params: list[torch.Tensor], group: dict[str, Any], divisor: float) -> None:
        """One step for same-device, same-dtype ``params``; fp16/bf16 ones are computed in fp32."""
        beta1, beta2 = group["betas"]
        exp_avgs, exp_avg_sqs, step_sizes = self._state(params, group)
        low_precision = params[0].dtype in _LOW_PRECISION
        work = [p.float() for p in params] if low_precision else params
        grads = [p.grad.to(work[0].dtype) for p in params]

        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=(1 - beta1) / divisor)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=(1 - beta2) / divisor**2)
        del grads

        if group["eps_inside_sqrt"]:
            denom = torch._foreach_add(exp_avg_sqs, group["eps"])
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(exp_avgs, denom)
        del denom
        if group["weight_decay"] != 0:
            torch._foreach_add_(update, work, alpha=group["weight_decay"])

        w_norm = torch.stack(torch._foreach_norm(work))
        u_norm = torch.stack(torch._foreach_norm(update))
        ratio = (w_norm / u_norm).clamp_max(group["max_coeff"]).clamp_min(group["min_coeff"])
        ratio = torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))
        sizes = torch.tensor(step_sizes, dtype=ratio.dtype, device=ratio.device)
        torch._foreach_mul_(update, (ratio * sizes).neg().unbind(0))
        torch._foreach_add_(work, update)
        if low_precision:
            torch._foreach_copy_(params, work)


def _step_size(group: dict[str, Any], step: int) -> float:
    if not group["bias_correction"]:
        return group["lr"]
    beta1, beta2 = group["betas"]
    return group["lr"] * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """2-norms of same-dtype tensors; fp16/bf16 are reduced in fp32 so the norm cannot overflow."""
    dtype = torch.float32 if tensors[0].dtype in _LOW_PRECISION else None
    return list(torch._foreach_norm(tensors, 2, dtype=dtype))


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(buckets.values())
