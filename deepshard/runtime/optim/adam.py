"""The Adams: DeepSpeed's ``FusedAdam`` and ``DeepSpeedCPUAdam`` on torch's Adam
(:class:`TorchAdam`), and :class:`KernelAdam` on deepshard's own CUDA kernel.

torch's ``Adam`` with ``fused=True`` is a multi-tensor kernel on CPU and on CUDA (on CPU as
fast as DeepSpeed's C++ Adam, DESIGN.md), needs no build, and its numbers are torch's own Adam
and AdamW: ``adam_w_mode`` picks decoupled weight decay (AdamW) or L2 decay added to the
gradient (Adam), per param group through torch's ``decoupled_weight_decay``. What torch lacks
is DeepSpeed's ``bias_correction=False``: the param groups that ask for it are stepped by
:func:`deepshard.kernels.adam.adam_reference` (the formulas, with the correction off) and
keep the same state (``step``, ``exp_avg``, ``exp_avg_sq``) as torch's groups. These are what
``deepspeed.ops.adam.FusedAdam`` and ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (DeepSpeed's
names) resolve to.

:class:`KernelAdam` steps with :func:`deepshard.kernels.adam.fused_adam_step` (the CUDA kernel
``cuda/adam.cu``, its torch reference off the GPU), measured against torch's kernel; no
DeepSpeed name resolves to it, and configs keep torch's Adam (``build.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from deepshard.kernels.adam import adam_reference, fused_adam_step
from deepshard.runtime.optim.base import StepOptimizer

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "KernelAdam", "TorchAdam", "moment_columns"]

FUSED_DEVICES = ("cpu", "cuda")


class TorchAdam(StepOptimizer, torch.optim.Adam):
    """torch's Adam/AdamW with DeepSpeed's ``bias_correction``, ``adam_w_mode`` and
    ``set_grad_none``; ``amsgrad`` raises ``RuntimeError`` (DeepSpeed's Adams have none).

    Uses torch's fused kernel when every parameter is a dense floating tensor on the CPU or
    a GPU, its default implementation otherwise. ``what`` names the class in errors.
    """

    what = "Adam"
    param_groups: list[dict[str, Any]]  # torch's; set aside for a moment in _take_step

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True) -> None:
        if amsgrad:
            raise RuntimeError(f"{self.what} does not support the AMSGrad variant.")
        groups = _materialise(params)
        super().__init__(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode,
                         fused=True if _fusable(groups) else None)
        self.defaults["bias_correction"] = bias_correction
        for group in self.param_groups:
            group.setdefault("bias_correction", bias_correction)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, refusing ``amsgrad`` and filling ``bias_correction`` from the defaults."""
        if param_group.get("amsgrad", False):
            raise RuntimeError(f"{self.what} does not support the AMSGrad variant.")
        if "bias_correction" in self.defaults:
            param_group.setdefault("bias_correction", self.defaults["bias_correction"])
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("bias_correction", True)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients: to ``None`` unless ``set_grad_none`` was false (or
        ``set_to_none`` says otherwise)."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def _take_step(self) -> None:
        """One Adam step for every parameter with a gradient: torch's for the groups with
        bias correction, :func:`adam_reference` for those without."""
        groups: list[dict[str, Any]] = self.param_groups
        corrected = [g for g in groups if g["bias_correction"]]
        if corrected:
            self.param_groups = corrected  # torch's step walks self.param_groups
            try:
                _torch_step(self)
            finally:
                self.param_groups = groups
        for group in groups:
            if not group["bias_correction"]:
                self._step_uncorrected(group)

    def _step_uncorrected(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{self.what} does not support sparse gradients")
            state = self.state[p]
            if not state:  # torch's layout, so that the state moves between groups
                state["step"] = torch.zeros((), dtype=torch.float32,
                                            device=p.device if group["fused"] else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            adam_reference([p], [p.grad], [state["exp_avg"]], [state["exp_avg_sq"]],
                           step=int(state["step"]), lr=float(group["lr"]), beta1=beta1,
                           beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                           decoupled=group["decoupled_weight_decay"], bias_correction=False)


class FusedAdam(TorchAdam):
    """DeepSpeed's ``FusedAdam`` (``deepspeed.ops.adam.FusedAdam``) with its constructor:
    AdamW (``adam_w_mode=True``, the default) or Adam with L2 weight decay, numerically
    torch's ``AdamW`` / ``Adam``, on torch's fused kernels (CPU and CUDA alike, nothing to
    build).

    Args:
        params: tensors, or param-group dicts, to optimise.
        lr: learning rate.
        bias_correction: Adam's bias correction (per group; ``False`` is supported).
        betas: decay rates of the first and second moments.
        eps: added to the denominator.
        adam_w_mode: decoupled weight decay (AdamW) instead of L2 decay.
        weight_decay: the decay.
        amsgrad: not supported; ``True`` raises ``RuntimeError``.
        set_grad_none: ``zero_grad()`` sets gradients to ``None`` (else zeros them).
    """

    what = "FusedAdam"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=adam_w_mode, weight_decay=weight_decay, amsgrad=amsgrad,
                         set_grad_none=set_grad_none)


class DeepSpeedCPUAdam(TorchAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam`` (``deepspeed.ops.adam.DeepSpeedCPUAdam``) with its
    constructor: AdamW (``adamw_mode=True``, the default) or Adam with L2 weight decay,
    numerically torch's ``AdamW`` / ``Adam``, on torch's fused kernel, which on the CPU runs as
    fast as DeepSpeed's C++ Adam and needs no build. It steps parameters on any device.

    ``fp32_optimizer_states`` is recorded; the moments are kept in the dtype of the tensors
    stepped, which inside an engine are fp32 (masters or ZeRO shards) whatever the model's
    precision. ``amsgrad=True`` raises ``RuntimeError``, as in DeepSpeed.
    """

    what = "DeepSpeedCPUAdam"

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, amsgrad: bool = False,
                 adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas,
                         eps=eps, adam_w_mode=adamw_mode, weight_decay=weight_decay,
                         amsgrad=amsgrad, set_grad_none=True)
        self.fp32_optimizer_states = fp32_optimizer_states


class KernelAdam(StepOptimizer):
    """Adam (``adam_w_mode=False``, L2 decay) or AdamW on deepshard's CUDA kernel
    (``cuda/adam.cu``); :func:`~deepshard.kernels.adam.adam_reference` off the GPU.

    Until moved here it was ``deepshard.kernels.adam.FusedAdam``; DeepSpeed's ``FusedAdam``
    is :class:`FusedAdam` (torch's kernel), which this one is benchmarked against.

    State per parameter, as DeepSpeed keeps it: ``step`` (int), ``exp_avg`` and
    ``exp_avg_sq`` in fp32 whatever the parameter dtype. Each param group is updated by
    :func:`~deepshard.kernels.adam.fused_adam_step`, one launch per (device, dtype, step)
    bucket.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0,
                 amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("FusedAdam does not support amsgrad")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, "
                             f"{weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {tuple(betas)}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        adam_w_mode=adam_w_mode, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def _take_step(self) -> None:
        """Apply one update to every parameter that has a gradient."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("FusedAdam does not support sparse gradients")
            beta1, beta2 = group["betas"]
            for (_, _, step), (ps, gs, ms, vs) in moment_columns(self.state, params).items():
                fused_adam_step(ps, gs, ms, vs, step=step, lr=group["lr"], beta1=beta1,
                                beta2=beta2, eps=group["eps"],
                                weight_decay=group["weight_decay"],
                                decoupled=group["adam_w_mode"],
                                bias_correction=group["bias_correction"])


def moment_columns(states: dict[torch.Tensor, Any], params: Sequence[torch.Tensor]
                   ) -> dict[tuple[torch.device, torch.dtype, int], list[list[torch.Tensor]]]:
    """Advance each param's step and group (param, grad, exp_avg, exp_avg_sq) columns by
    (device, dtype, step): what one multi-tensor launch takes. ``states`` is the
    optimizer's ``state`` (param to its state dict). Moments are created, or brought back
    to, fp32 (``load_state_dict`` casts state to the param's dtype); grads are made
    contiguous in the param dtype (no copy when they already are)."""
    columns: dict[tuple[torch.device, torch.dtype, int], list[list[torch.Tensor]]] = {}
    for p in params:
        state = states[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        elif state["exp_avg"].dtype != torch.float32:
            state["exp_avg"] = state["exp_avg"].float()
            state["exp_avg_sq"] = state["exp_avg_sq"].float()
        state["step"] += 1
        cols = columns.setdefault((p.device, p.dtype, state["step"]), [[], [], [], []])
        grad = p.grad.to(p.dtype).contiguous()
        for col, t in zip(cols, (p, grad, state["exp_avg"], state["exp_avg_sq"]), strict=True):
            col.append(t)
    return columns


def _torch_step(optimizer: TorchAdam) -> None:
    """torch's ``Adam.step`` itself: without the hook wrapper torch puts on the class once a
    plain ``Adam`` exists, which would run the step hooks a second time."""
    step = torch.optim.Adam.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    step(optimizer)


def _materialise(params: Iterable[Any]) -> list[Any]:
    """The parameters as a list (of tensors, or of group dicts with listed params)."""
    items = list(params)
    return [{**item, "params": [item["params"]] if torch.is_tensor(item["params"])
             else list(item["params"])} if isinstance(item, dict) else item for item in items]


def _fusable(groups: list[Any]) -> bool:
    """Whether torch's fused kernel takes every parameter: dense floating tensors on a CPU or
    a GPU (the rule ``runtime/optim/build.py`` applies to config-built Adams)."""
    tensors = [t for item in groups
               for t in (item["params"] if isinstance(item, dict) else [item])]
    return bool(tensors) and all(
        type(t.data) is torch.Tensor and t.layout == torch.strided and t.is_floating_point()
        and t.device.type in FUSED_DEVICES for t in tensors)
