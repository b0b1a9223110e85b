"""A ``Linear`` head and its cross-entropy over tiles of tokens, differentiated by hand.

:func:`~deepshard.sequence.tiled.tiled_logits_loss` takes this path when the head is a plain
``torch.nn.Linear`` with no hooks (anything else goes through autograd, tile by tile). Per
tile it computes the logits into one ``[tile, vocab]`` buffer that every tile reuses, turns
them in place into the softmax and then into the loss gradient ``softmax - onehot``, and
accumulates the weight gradient with one ``addmm_``: no tile allocates a logits-sized
tensor, where the autograd path allocates four (logits, log-softmax, its gradient, the
weight gradient). Big allocations are not free on CPU: deepshard fixes glibc's mmap
threshold (:mod:`deepshard.runtime.allocator`), so each one is a fresh ``mmap`` whose pages
fault in zeroed; at a 64-token tile of a 32000 vocabulary that made the autograd path 1.6x
slower inside the engine than outside it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["LinearCrossEntropy", "fusable", "linear_cross_entropy", "tile_bounds"]


def fusable(head: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether ``head(x)`` is exactly ``F.linear(x, head.weight, head.bias)``: a plain
    ``Linear`` without hooks (ZeRO-3 gathers through hooks), materialised weights of ``x``'s
    dtype, and no autocast that would change the matmul's dtype."""
    if type(head) is not torch.nn.Linear:
        return False
    if head._forward_pre_hooks or head._forward_hooks or head._backward_hooks:
        return False
    weight = head.weight
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight.dtype != x.dtype:
        return False
    return not torch.is_autocast_enabled(x.device.type)


def tile_bounds(rows: int, shards: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of (at most) ``shards`` equal tiles of ``rows`` rows."""
    step = math.ceil(rows / max(1, shards)) if rows else 1
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, *, ignore_index: int, shards: int,
                         need: tuple[bool, bool, bool]) -> tuple[torch.Tensor, ...]:
    """Sum over ``x``'s rows of ``F.cross_entropy(F.linear(x, weight, bias).float(),
    labels, ignore_index=ignore_index, reduction="sum")``, ``shards`` tiles at a time, and
    its gradients for ``(x, weight, bias)`` where ``need`` asks (else None).

    The logits are computed in ``weight``'s dtype and the loss in at least fp32, as HF's
    causal-LM loss does; the gradients come back in their tensors' dtypes.
    """
    need_x, need_w, need_b = need
    train = need_x or need_w or need_b
    dtype = torch.promote_types(weight.dtype, torch.float32)
    bounds = tile_bounds(x.shape[0], shards)
    width = max((b - a for a, b in bounds), default=0)
    buffer = x.new_empty((width, weight.shape[0]), dtype=dtype)
    total = x.new_zeros((), dtype=dtype)
    x_grad = torch.empty_like(x) if need_x else None
    w_grad = torch.zeros_like(weight) if need_w else None
    b_grad = torch.zeros_like(bias) if need_b and bias is not None else None
    for a, b in bounds:
        rows, target = x[a:b], labels[a:b]
        logits = buffer[:b - a]
        if weight.dtype == dtype:
            torch.matmul(rows, weight.t(), out=logits)
            if bias is not None:
                logits.add_(bias)
        else:
            logits.copy_(F.linear(rows, weight, bias))
        valid = target != ignore_index
        index = torch.where(valid, target, 0).unsqueeze(1)
        picked = logits.gather(1, index).squeeze(1)
        peak = logits.amax(dim=1, keepdim=True)
        sums = logits.sub_(peak).exp_().sum(dim=1)
        total += ((peak.squeeze(1) + sums.log() - picked) * valid).sum()
        if not train:
            continue
        logits.div_(sums.unsqueeze(1))  # the softmax
        logits.scatter_add_(1, index, valid.to(dtype).neg().unsqueeze(1))
        logits.mul_(valid.unsqueeze(1))  # ignored rows: no gradient
        grad = logits if weight.dtype == dtype else logits.to(weight.dtype)
        if x_grad is not None:
            torch.matmul(grad, weight, out=x_grad[a:b])
        if w_grad is not None:
            w_grad.addmm_(grad.t(), rows)
        if b_grad is not None:
            b_grad.add_(grad.sum(dim=0))
    return total, x_grad, w_grad, b_grad


class LinearCrossEntropy(torch.autograd.Function):
    """:func:`linear_cross_entropy` divided by ``denominator``, as an autograd function:
    the gradients are computed in the forward and scaled by the incoming one in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, labels: torch.Tensor, denominator: torch.Tensor,
                ignore_index: int, shards: int, need: tuple[bool, bool, bool],
                weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        total, *grads = linear_cross_entropy(x, weight, bias, labels,
                                             ignore_index=ignore_index, shards=shards,
                                             need=need)
        ctx.grads = grads
        ctx.denominator = denominator.to(total.dtype)
        return total / ctx.denominator

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scale = grad / ctx.denominator
        x_grad, w_grad, b_grad = (None if g is None else g * scale.to(g.dtype)
                                  for g in ctx.grads)
        ctx.grads = ()
        return x_grad, None, None, None, None, None, w_grad, b_grad
