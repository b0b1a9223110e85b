"""fp16/bf16 training: the model in half precision, fp32 master weights for the optimizer.

As in DeepSpeed, enabling ``fp16`` or ``bf16`` casts the module's floating parameters to
that dtype; forward and backward run in it. The optimizer steps fp32 *master* copies, laid
out as one flat fp32 buffer per gradient bucket (so unscaling, the overflow check and the
grad norm are a few passes over big tensors), and the result is copied back into the
module. With fp32 training there are no master copies at all: the optimizer steps the
module's own parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepshard.runtime.buckets import BucketLayout


class MasterWeights:
    """fp32 master parameters and gradients mirroring half-precision ``params``."""

    def __init__(self, params: Sequence[torch.nn.Parameter], layouts: Sequence[BucketLayout]):
        self.params = list(params)
        self.flats = [torch.empty(b.numel, dtype=torch.float32, device=self.params[0].device)
                      for b in layouts]
        self.grad_flats = [torch.zeros_like(f) for f in self.flats]
        self.masters: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        self.grad_views: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        for flat, gflat, layout in zip(self.flats, self.grad_flats, layouts, strict=True):
            for i, off in zip(layout.params, layout.offsets, strict=True):
                p = self.params[i]
                master = flat[off:off + p.numel()].view_as(p)
                master.copy_(p.detach())
                self.grad_views[i] = gflat[off:off + p.numel()].view_as(p)
                master.grad = self.grad_views[i]
                self.masters[i] = master

    def master_of(self) -> dict[int, torch.Tensor]:
        """``id(model param)`` → its master, to rebuild an optimizer's param groups."""
        return {id(p): m for p, m in zip(self.params, self.masters, strict=True)}

    def load_grads(self, grad_buffers: Sequence[torch.Tensor], inv_scale: float) -> None:
        """Master grads = reduced half-precision grads × ``inv_scale`` (loss-scale undone)."""
        for master, view in zip(self.masters, self.grad_views, strict=True):
            master.grad = view  # the user's optimizer.zero_grad() may have set it to None
        for gflat, buf in zip(self.grad_flats, grad_buffers, strict=True):
            gflat.copy_(buf)
        if inv_scale != 1.0:
            torch._foreach_mul_(self.grad_flats, inv_scale)

    def copy_to_model(self) -> None:
        """Write the stepped masters back into the module's half-precision parameters."""
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params], self.masters)

    def nbytes(self) -> tuple[int, int]:
        """Bytes of (master params, master grads)."""
        size = sum(f.numel() * 4 for f in self.flats)
        return size, size


def global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all ``tensors`` in fp32; inf or nan when any element is."""
    if not tensors:
        return torch.zeros(())
    norms = torch._foreach_norm([t.float() if t.dtype != torch.float32 else t for t in tensors])
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_(tensors: Sequence[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``tensors`` so their global norm is at most ``max_norm`` (torch's rule)."""
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(list(tensors), coef)
