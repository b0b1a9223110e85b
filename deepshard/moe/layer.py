"""``deepspeed.moe.layer.MoE``: the layer DeepSpeed users build, with its signature,
parameter names and return value ``(output, l_aux, exp_counts)``.

Its experts are ``num_experts // ep_size`` deep copies of ``expert`` on every rank (rank
``r`` of the expert-parallel group holds global experts ``r * L .. r * L + L - 1``); with
``use_residual=True`` (PR-MoE) ``expert`` itself is kept as a dense MLP (``mlp``) and a
``coefficient`` Linear mixes the two outputs, as DeepSpeed does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepshard.moe.experts import Experts
from deepshard.moe.sharded_moe import MOELayer, TopKGate
from deepshard.runtime.parallel.expert_groups import (
    ExpertGroups,
    check_sizes,
    configure,
    group_name,
)


class MoE(nn.Module):
    """An MoE layer (DeepSpeed's arguments; ``use_tutel`` and
    ``enable_expert_tensor_parallelism`` are accepted and have no effect).

    Args:
        hidden_size: input and output dimension.
        expert: the module each expert is a deep copy of.
        num_experts: experts in the layer, over all ranks of an expert-parallel group.
        ep_size: ranks in an expert-parallel group (divides ``num_experts`` and the
            data-parallel size).
        k: experts per token (1, 2 or more).
        capacity_factor / eval_capacity_factor: capacity per expert, training / eval,
            relative to an even split.
        min_capacity: the least capacity per expert.
        use_residual: Residual MoE (PR-MoE).
        noisy_gate_policy: None, 'Jitter' or 'RSample'.
        drop_tokens: False for dropless routing (infinite capacity).
        use_rts: random token selection when an expert overflows (top-1).
        top2_2nd_expert_sampling: Gumbel sampling of the second expert (top-2).
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1,
                 ep_size: int = 1, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        check_sizes(num_experts, ep_size)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor,
                        min_capacity, noisy_gate_policy, drop_tokens, use_rts, None,
                        top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size,
                                      self.num_local_experts, use_tutel=use_tutel)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create (or find) this layer's groups over the whole world: a collective."""
        configure(self, use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """``(output, l_aux, exp_counts)``; ``used_token`` masks tokens out (top-1)."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts

    @property
    def expert_groups(self) -> ExpertGroups | None:
        """The :class:`~deepshard.runtime.parallel.expert_groups.ExpertGroups` in use (None
        before configure)."""
        return self.deepspeed_moe.expert_groups


def is_moe_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an :class:`MoE`."""
    return isinstance(module, MoE)
