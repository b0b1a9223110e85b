"""The loss of a sequence-parallel group: averaged over the group's valid tokens.

Each rank of a group holds ``1/P`` of a batch's tokens, so its own mean is not the batch's
(padding and ``-100`` labels fall unevenly). :func:`sequence_parallel_mean` divides the
group's sum of token losses by its count of valid tokens, the same value on every rank
of the group. The sum is an all-reduce whose backward all-reduces the gradient, so each
rank's backward carries ``P`` times its tokens' share: with the engine averaging gradients
over all ``data x sequence`` ranks, that is exactly the data-parallel gradient of the
per-batch mean (ALST's contract; a rank's plain local mean is exact only when every rank
holds as many valid tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def sequence_parallel_mean(loss_sum: Tensor, valid_tokens: Tensor | int, group: Any = None
                           ) -> Tensor:
    """The mean token loss of the whole group, from this rank's sum of token losses
    ``loss_sum`` (differentiable) and its number of valid tokens. ``group=None`` or a
    group of one: the local mean. A group with no valid token gives 0 (not NaN)."""
    count = torch.as_tensor(valid_tokens, dtype=loss_sum.dtype, device=loss_sum.device)
    if group is None or dist.get_world_size(group) == 1:
        return loss_sum / count.clamp(min=1)
    count = count.detach().clone()
    dist.all_reduce(count, group=group)
    return _AllReduce.apply(loss_sum, group) / count.clamp(min=1)


class _AllReduce(torch.autograd.Function):
    """Sum over ``group``; the gradient is the sum of the ranks' gradients (each rank's
    output feeds its own loss)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        out = tensor.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.detach().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sequence_parallel_loss(logits: Tensor, shift_labels: Tensor, group: Any = None,
                           ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Causal-LM cross entropy of this rank's shard, averaged over the group's valid
    tokens: ``logits`` ``[batch, seq/P, vocab]`` and ``shift_labels`` ``[batch, seq/P]``,
    the next token's label at each position (what
    :func:`deepshard.sequence.loader.shard_batch` puts in the batch; ``ignore_index`` where
    there is none)."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    labels = shift_labels.reshape(-1).to(flat.device)
    loss_sum = F.cross_entropy(flat, labels, ignore_index=ignore_index, reduction="sum")
    return sequence_parallel_mean(loss_sum, (labels != ignore_index).sum(), group)
