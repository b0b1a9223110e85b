"""``deepspeed.ops.lamb.fused_lamb``: ``FusedLamb`` with DeepSpeed's constructor.

It is :class:`deepshard.kernels.lamb.FusedLamb`: the CUDA kernel when every tensor of a step
is on a GPU and CuPy is installed, else :func:`~deepshard.kernels.lamb.lamb_reference`, the
update the runtime's :class:`~deepshard.runtime.optim.lamb.Lamb` (what a config's ``LAMB``
builds on the CPU) also runs; the state (``step``, ``exp_avg``, ``exp_avg_sq``) is the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...kernels.lamb import FusedLamb as _KernelLamb

__all__ = ["FusedLamb"]


class FusedLamb(_KernelLamb):
    """DeepSpeed's ``FusedLamb`` (its arguments and update; see the module docstring).

    ``amsgrad=True`` raises ``RuntimeError``, and a bad hyperparameter ``ValueError``.
    DeepSpeed's ``get_lamb_coeffs()`` (the trust ratios of every step so far) is not kept.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False):
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                         max_grad_norm=max_grad_norm, max_coeff=max_coeff,
                         min_coeff=min_coeff)
