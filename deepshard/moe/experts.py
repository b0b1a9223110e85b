"""``deepspeed.moe.experts.Experts``: a rank's local experts, deep copies of one module.

Parameters keep DeepSpeed's names (``deepspeed_experts.{j}....``) and marks
(``allreduce = False``, ``group_name``), one set per expert. The layer runs them with
:meth:`Experts.grouped` on a ``[L, width, M]`` buffer: an expert that is a ``Linear`` or
a ``Sequential`` of ``Linear`` layers and parameter-free elementwise activations (the
common MLP) runs as one batched matmul per ``Linear`` over all local experts (their
weights stacked, ``torch.baddbmm``); any other module runs expert by expert on its own
tokens only, which is logged once.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.LeakyReLU,
               nn.ELU, nn.Mish, nn.Softplus)
"""Activation modules the grouped path applies to the whole buffer."""


def linear_stack(expert: nn.Module) -> list[nn.Module] | None:
    """The layers of ``expert`` when it is a Linear/activation stack, else None."""
    if isinstance(expert, nn.Linear):
        return [expert]
    if isinstance(expert, nn.Sequential) and len(expert) and all(
            type(m) is nn.Linear or type(m) in ELEMENTWISE for m in expert):
        return list(expert)
    return None


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert``, marked as expert parameters of
    the group ``expert_group_name``."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1,
                 expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            [copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for one in self.deepspeed_experts:
            for param in one.parameters():
                param.allreduce = False
                param.group_name = expert_group_name
        self.is_grouped = linear_stack(expert) is not None
        self._logged = False

    def forward(self, inputs: Tensor) -> Tensor:
        """DeepSpeed's: ``inputs`` is ``[ep, L, C, M]``; chunk ``j`` of dim 1 goes to
        expert ``j``."""
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        return torch.cat([_first(one(chunk)) for chunk, one in
                          zip(chunks, self.deepspeed_experts, strict=True)], dim=1)

    def grouped(self, x: Tensor, counts: list[int]) -> Tensor:
        """Expert ``j`` on ``x[j, :counts[j]]``, for a ``[L, width, M]`` buffer; rows past
        a count are padding, their outputs unspecified."""
        if self.is_grouped:
            return self._batched(x)
        if not self._logged:
            self._logged = True
            log.info("MoE experts of type %s are not a Linear/activation stack: the %d "
                     "local experts run one after another",
                     type(self.deepspeed_experts[0]).__name__, self.num_local_experts)
        outs = [_first(one(x[j, :counts[j]])) for j, one in enumerate(self.deepspeed_experts)]
        width = x.shape[1]
        return torch.stack([torch.nn.functional.pad(o, (0, 0, 0, width - o.shape[0]))
                            for o in outs])

    def _batched(self, x: Tensor) -> Tensor:
        # Feature-major layout: h is [L, features, width] and each Linear is W @ h. With
        # the stacked weights [L, out, in] as the left operand their gradients come out
        # contiguous in the parameters' own layout (x @ W^T gave transposed gradients,
        # copied again for every expert); on CPU this halves the experts' time.
        stacks = [linear_stack(one) for one in self.deepspeed_experts]
        h = x.transpose(1, 2)
        for position, layer in enumerate(stacks[0] or []):
            if not isinstance(layer, nn.Linear):
                h = layer(h)
                continue
            weight = torch.stack([s[position].weight for s in stacks if s])  # [L, out, in]
            if layer.bias is None:
                h = torch.bmm(weight, h)
            else:
                bias = torch.stack([s[position].bias for s in stacks if s])
                h = torch.baddbmm(bias.unsqueeze(2), weight, h)
        return h.transpose(1, 2)


def _first(out: Tensor | tuple) -> Tensor:
    return out[0] if isinstance(out, tuple) else out
