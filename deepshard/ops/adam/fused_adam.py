"""``deepspeed.ops.adam.fused_adam``: ``FusedAdam`` with DeepSpeed's constructor, on torch's
fused Adam kernels (see :mod:`.torch_adam`); CPU and CUDA alike, nothing to build."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .torch_adam import TorchAdam

__all__ = ["FusedAdam"]


class FusedAdam(TorchAdam):
    """DeepSpeed's ``FusedAdam``: AdamW (``adam_w_mode=True``, the default) or Adam with L2
    weight decay, numerically torch's ``AdamW`` / ``Adam``.

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
                 set_grad_none: bool = True):
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=adam_w_mode, weight_decay=weight_decay, amsgrad=amsgrad,
                         set_grad_none=set_grad_none)
