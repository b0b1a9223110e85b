"""``replace_with_kernel_inject=True``: deepshard's fused inference path.

DeepSpeed swaps whole transformer layers for its CUDA inference kernels (and fails on a
CPU). deepshard keeps the model's own layers and routes their hot spots: attention through
``torch.nn.functional.scaled_dot_product_attention`` with the KV cache (HF's ``sdpa``
attention, a fused kernel on every device), and, on CUDA, every ``nn.LayerNorm`` through the
CuPy kernel of :mod:`deepshard.kernels.layer_norm`. On a CPU the LayerNorm stays torch's,
which is that kernel's reference. The tokens are the same as without it (the tests check
greedy tokens for equality).
"""

from __future__ import annotations

import torch
from torch import nn


class KernelLayerNorm(nn.LayerNorm):
    """An ``nn.LayerNorm`` (same parameters, same state dict) computed by the CuPy kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepshard.kernels.layer_norm import layer_norm

        if self.weight is None or len(self.normalized_shape) != 1:
            return super().forward(x)
        return layer_norm(x, self.weight, self.bias, self.eps)


def inject_kernels(model: nn.Module, device: torch.device) -> tuple[str, ...]:
    """Route ``model``'s attention through SDPA and, on CUDA, its LayerNorms through the
    kernel; returns one line per change made."""
    done = []
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation("sdpa")
            done.append("attention: scaled_dot_product_attention (HF sdpa)")
        except (ValueError, ImportError) as exc:  # the architecture has no SDPA path
            done.append(f"attention: the model's own ({str(exc).splitlines()[0][:80]})")
    if device.type == "cuda":
        norms = [m for m in model.modules() if type(m) is nn.LayerNorm]
        for m in norms:
            m.__class__ = KernelLayerNorm
        if norms:
            done.append(f"{len(norms)} LayerNorm(s): the CuPy kernel")
    return tuple(done)
