"""``deepspeed.moe.sharded_moe``: the gate (:class:`TopKGate`) and the layer that routes
tokens to experts across the expert-parallel group (:class:`MOELayer`).

The gating functions are DeepSpeed's (``gating.py``); the exchange differs in what it
sends, not in the math: only routed tokens travel, with uneven splits (``dispatch.py``),
and the local experts run as one grouped matmul (``experts.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module

from deepshard.errors import UsageError
from deepshard.moe.dispatch import _AllToAll, combine, dispatch, plan
from deepshard.moe.gating import (
    Routes,
    _capacity,
    gumbel_rsample,
    multiplicative_jitter,
    route_top1,
    route_top2,
    route_topk,
    top1gating,
    top2gating,
    topkgating,
)
from deepshard.runtime.parallel.expert_groups import ExpertParallelLayer

if TYPE_CHECKING:
    from deepshard.runtime.parallel.expert_groups import ExpertGroups

__all__ = ["MOELayer", "TopKGate", "_AllToAll", "_capacity", "gumbel_rsample",
           "multiplicative_jitter", "top1gating", "top2gating", "topkgating"]

NOISY_POLICIES = (None, "None", "Jitter", "RSample")


class TopKGate(Module):
    """DeepSpeed's gate: a bias-free ``Linear(model_dim, num_experts)`` (``wg``) in fp32,
    then top-1, top-2 or top-k gating with the given capacity settings."""

    wg: torch.nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                 min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if k < 1 or k > num_experts:
            raise UsageError(f"k={k} must be between 1 and num_experts={num_experts}",
                             where="MoE(k=...)")
        if noisy_gate_policy not in NOISY_POLICIES:
            raise UsageError(f"noisy_gate_policy={noisy_gate_policy!r} is not one of "
                             "'Jitter', 'RSample', None", where="MoE(noisy_gate_policy=...)")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group

    def logits(self, input: Tensor) -> Tensor:
        """The fp32 gate logits (with Jitter noise on the input when training)."""
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=input.device)
        return torch.nn.functional.linear(x, weight=self.wg.weight.float(), bias=None)

    def route(self, input: Tensor, used_token: Tensor | None = None,
              ep_group: Any = None) -> tuple[Tensor, Routes, Tensor]:
        """``(l_aux, routes, exp_counts)`` for ``[S, M]`` tokens."""
        logits = self.logits(input)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return route_top1(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None,
                              self.drop_tokens, self.use_rts, ep_group)
        if self.k == 2:
            return route_top2(logits, factor, self.min_capacity, self.drop_tokens, ep_group,
                              self.top2_2nd_expert_sampling)
        return route_topk(logits, self.k, factor, self.min_capacity, self.drop_tokens, ep_group)

    def forward(self, input: Tensor, used_token: Tensor | None = None,
                sparse_routes: bool = False, use_tutel: bool = False) -> tuple:
        """DeepSpeed's return value: ``(l_aux, combine_weights, dispatch_mask,
        exp_counts)``, or the sparse tuple with ``sparse_routes=True``."""
        from deepshard.moe.gating import dense, sparse

        del use_tutel
        l_aux, routes, counts = self.route(input, used_token, self.ep_group)
        return sparse(l_aux, routes, counts) if sparse_routes else (l_aux, *dense(routes),
                                                                   counts)


class MOELayer(ExpertParallelLayer, Module):
    """Gate, exchange, experts, exchange back, combine (GShard's algorithm 2).

    ``forward(hidden_states, used_token=None)`` returns the output and leaves the gate's
    load-balancing loss in ``l_aux`` and the per-expert token counts (before capacity
    dropping) in ``exp_counts``. With ``ep_size > 1`` its groups must have been set
    (:func:`deepshard.runtime.parallel.expert_groups.configure`, which ``deepshard.initialize`` and
    ``MoE.set_deepspeed_parallelism`` call).
    """

    def __init__(self, gate: Module, experts: Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: Any = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.expert_groups: ExpertGroups | None = None
        self.use_tutel = False
        del use_tutel
        self.wall_clock_breakdown = False
        self.time_falltoall = self.time_salltoall = self.time_moe = 0.0
        self.sent_rows = 0

    @property
    def expert_group_name(self) -> str:
        return self.ep_group_name

    @property
    def num_experts(self) -> int:
        return self.num_local_experts * self.ep_size

    def set_expert_groups(self, groups: ExpertGroups) -> None:
        """Use ``groups`` (their ``ep_size`` must be this layer's)."""
        assert groups.ep_size == self.ep_size, (groups.name, self.ep_group_name)
        self.expert_groups = groups
        self._set_ep_group(groups.ep_group)

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        if self.ep_size > 1 and self.expert_groups is None:
            raise UsageError(f"this MoE layer (ep_size={self.ep_size}) has no expert-parallel "
                             "group yet", where="MoE.forward",
                             hint="wrap the model with deepshard.initialize, or call "
                             "deepshard.runtime.parallel.expert_groups.configure(model) first")
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else kwargs.get("used_token")
        tokens = hidden.reshape(-1, hidden.shape[-1])
        # no capacity agreement: only routed tokens travel (dispatch.py)
        self.l_aux, routes, self.exp_counts = self.gate.route(
            tokens, used_token)
        p = plan(routes, self.ep_size, self.ep_group)
        if self.expert_groups is not None:
            self.sent_rows = sum(p.send) - p.send[self.expert_groups.ep_rank]
        buffer = dispatch(tokens, p, self.ep_size, self.ep_group)
        out = self.experts.grouped(buffer, p.local_counts)
        out = combine(out, p, tokens.shape[0], self.ep_size, self.ep_group)
        return out.reshape(*hidden.shape[:-1], out.shape[-1])
