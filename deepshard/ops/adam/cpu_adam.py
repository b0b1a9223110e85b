"""``deepspeed.ops.adam.cpu_adam``: ``DeepSpeedCPUAdam`` with DeepSpeed's constructor, on
torch's fused Adam kernel (see :mod:`.torch_adam`), which on the CPU runs as fast as
DeepSpeed's C++ Adam and needs no build. It steps parameters on any device."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .torch_adam import TorchAdam

__all__ = ["DeepSpeedCPUAdam"]


class DeepSpeedCPUAdam(TorchAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam``: AdamW (``adamw_mode=True``, the default) or Adam
    with L2 weight decay, numerically torch's ``AdamW`` / ``Adam``.

    ``fp32_optimizer_states`` is recorded; the moments are kept in the dtype of the tensors
    stepped, which inside an engine are fp32 (masters or ZeRO shards) whatever the model's
    precision. ``amsgrad=True`` raises ``RuntimeError``, as in DeepSpeed.
    """

    what = "DeepSpeedCPUAdam"

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, amsgrad: bool = False,
                 adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas,
                         eps=eps, adam_w_mode=adamw_mode, weight_decay=weight_decay,
                         amsgrad=amsgrad, set_grad_none=True)
        self.fp32_optimizer_states = fp32_optimizer_states
