"""DeepSpeed's Adam options on torch's Adam: the one class behind ``FusedAdam`` and
``DeepSpeedCPUAdam``.

torch's ``Adam`` with ``fused=True`` is a multi-tensor kernel on CPU and on CUDA (on CPU as
fast as DeepSpeed's C++ Adam, DESIGN.md), needs no build, and its numbers are torch's own Adam
and AdamW: ``adam_w_mode`` picks decoupled weight decay (AdamW) or L2 decay added to the
gradient (Adam), per param group through torch's ``decoupled_weight_decay``. What torch lacks
is DeepSpeed's ``bias_correction=False``: the param groups that ask for it are stepped by
:func:`deepshard.kernels.adam.adam_reference` (the formulas, with the correction off) and
keep the same state (``step``, ``exp_avg``, ``exp_avg_sq``) as torch's groups.

``deepshard.kernels.adam.FusedAdam`` (the CUDA kernel) stays where it is, measured against
torch's kernel; it is not what these names resolve to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ...kernels.adam import adam_reference

FUSED_DEVICES = ("cpu", "cuda")


class TorchAdam(torch.optim.Adam):
    """torch's Adam/AdamW with DeepSpeed's ``bias_correction``, ``adam_w_mode`` and
    ``set_grad_none``; ``amsgrad`` raises ``RuntimeError`` (DeepSpeed's Adams have none).

    Uses torch's fused kernel when every parameter is a dense floating tensor on the CPU or
    a GPU, its default implementation otherwise. ``what`` names the class in errors.
    """

    what = "Adam"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True):
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

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Adam step for every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
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
        return loss

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
