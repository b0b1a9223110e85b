"""Top-1, top-2 and top-k gating as DeepSpeed 0.19.8 computes it (``sharded_moe.py``).

Every decision is DeepSpeed's, in its order, and draws its random numbers in its order
from torch's generator (so a seeded run routes the same tokens): RSample's Gumbel noise,
then random token selection's uniform draw (top-1); the second expert's Gumbel sample
(top-2). Capacity is ``max(ceil(S / E * capacity_factor * k), min_capacity)``; with
``drop_tokens=False`` nothing is dropped (DeepSpeed's capacity, the largest count over
the expert-parallel group, only sizes its padded buffers: the routes are the same).

The core functions return :class:`Routes`: per route ``r`` (of ``k``) and token ``s``, the
expert (``-1`` when the capacity limit dropped it), its slot in that expert's buffer and
its combine weight. The DeepSpeed-named wrappers turn them into DeepSpeed's return values:
``(l_aux, combine_weights [S, E, C], dispatch_mask, exp_counts)``, or with
``sparse_routes=True`` its ``(l_aux, capacity, E, indices, locations, gates, exp_counts)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from deepshard.errors import UsageError


@dataclass(frozen=True)
class Routes:
    """Where each token goes.

    Attributes:
        indices: ``[k, S]`` int64 expert of each route, ``-1`` where it was dropped.
        locations: ``[k, S]`` int64 slot of the route in its expert's buffer.
        gates: ``[k, S]`` fp32 combine weight (0 where dropped), differentiable.
        capacity: the slots an expert has (for dropless routing: the local largest count).
        num_experts: ``E``.
    """

    indices: Tensor
    locations: Tensor
    gates: Tensor
    capacity: int
    num_experts: int


def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """``x`` times a uniform draw in ``[1 - epsilon, 1 + epsilon)`` (Switch's jitter)."""
    if epsilon == 0:
        return x
    low = torch.tensor(1.0 - epsilon, device=device)
    high = torch.tensor(1.0 + epsilon, device=device)
    return x * torch.distributions.uniform.Uniform(low, high).rsample(x.shape)


def gumbel_rsample(shape: tuple | torch.Size, device: torch.device) -> Tensor:
    """Standard Gumbel noise of ``shape``."""
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def _uniform(shape: torch.Size, device: torch.device) -> Tensor:
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.uniform.Uniform(zero, one).rsample(shape)


def _capacity(num_tokens: int, num_experts: int, capacity_factor: float,
              min_capacity: int) -> int:
    capacity = torch.ceil(torch.tensor(num_tokens / num_experts) * torch.tensor(capacity_factor))
    return max(int(capacity), int(min_capacity))


def _dropless_capacity(exp_counts: Tensor, ep_group: Any) -> int:
    """The largest expert count, over the expert-parallel group when one is given."""
    import torch.distributed as dist

    largest = torch.max(exp_counts).reshape(())
    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        largest = largest.clone()
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=ep_group)
    return int(largest)


def route_top1(logits: Tensor, capacity_factor: float, min_capacity: int,
               used_token: Tensor | None = None, noisy_gate_policy: str | None = None,
               drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None
               ) -> tuple[Tensor, Routes, Tensor]:
    """``(l_aux, routes, exp_counts)`` of DeepSpeed's top-1 gating."""
    if noisy_gate_policy == "RSample":
        noisy = logits + gumbel_rsample(logits.shape, device=logits.device)
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    capacity = _capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    indices = torch.argmax(noisy if noisy_gate_policy == "RSample" else gates, dim=1)
    mask = F.one_hot(indices, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.unsqueeze(1)
    exp_counts = torch.sum(mask, dim=0).detach()
    if not drop_tokens:
        capacity = min(_dropless_capacity(exp_counts, ep_group), num_tokens)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    ranked = mask * _uniform(mask.shape, logits.device) if use_rts else mask
    if num_tokens < min_capacity:
        raise UsageError(f"{num_tokens} tokens reach the gate, fewer than min_capacity="
                         f"{min_capacity}", where="MoE(min_capacity=...)",
                         hint="set min_capacity to 0 or increase the batch size")
    top = torch.topk(ranked, k=min(capacity, num_tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, top, 1)
    kept = mask.sum(dim=1) > 0
    locations = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
    routes = Routes(torch.where(kept, indices, -1).unsqueeze(0), locations.unsqueeze(0),
                    (gates * mask).sum(dim=1).unsqueeze(0), int(capacity), num_experts)
    return l_aux, routes, exp_counts


def route_top2(logits: Tensor, capacity_factor: float, min_capacity: int,
               drop_tokens: bool = True, ep_group: Any = None,
               top2_2nd_expert_sampling: bool = True) -> tuple[Tensor, Routes, Tensor]:
    """``(l_aux, routes, exp_counts)`` of DeepSpeed's top-2 gating."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    indices1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(indices1, num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits = logits + gumbel_rsample(logits.shape, device=logits.device)
    indices2 = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(indices2, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts ** 2
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, capacity)
        mask2 = mask2 * torch.lt(locations2, capacity)
    else:
        capacity = _dropless_capacity(exp_counts, ep_group)
    gates1 = (gates * mask1.float()).sum(dim=1)
    gates2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(gates1 + gates2, min=torch.finfo(gates.dtype).eps)
    indices = torch.stack([torch.where(mask1.any(dim=1), indices1, -1),
                           torch.where(mask2.any(dim=1), indices2, -1)])
    locations = torch.stack([torch.sum(locations1 * mask1, dim=1),
                             torch.sum(locations2 * mask2, dim=1)])
    routes = Routes(indices, locations, torch.stack([gates1 / denom, gates2 / denom]),
                    int(capacity), num_experts)
    return l_aux, routes, exp_counts


def route_topk(logits: Tensor, k: int, capacity_factor: float, min_capacity: int,
               drop_tokens: bool = True, ep_group: Any = None, drop_policy: str = "probs"
               ) -> tuple[Tensor, Routes, Tensor]:
    """``(l_aux, routes, exp_counts)`` of DeepSpeed's top-k gating (any ``k``)."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    exp_counts = torch.sum(mask, dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts ** 2 / k
    if not drop_tokens:
        capacity = _dropless_capacity(exp_counts, ep_group)
    else:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            masked = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            chosen = torch.topk(masked, k=min(capacity, num_tokens), dim=0, sorted=False)[1]
            mask &= torch.zeros_like(gates, dtype=torch.bool).scatter_(0, chosen, True)
        elif drop_policy == "position":
            mask &= torch.lt(torch.cumsum(mask, dim=0) - 1, capacity)
        else:
            raise UsageError(f"drop_policy={drop_policy!r} is not one of 'probs', 'position'",
                             where="topkgating(drop_policy=...)")
    locations = torch.cumsum(mask, dim=0) - 1
    masked_gates = gates * mask
    masked_gates = masked_gates / torch.clamp(masked_gates.sum(dim=-1, keepdim=True),
                                              min=torch.finfo(gates.dtype).eps)
    kept = mask.gather(1, top_idx)
    routes = Routes(torch.where(kept, top_idx, -1).t().contiguous(),
                    (locations.gather(1, top_idx) * kept).t().contiguous(),
                    masked_gates.gather(1, top_idx).t().contiguous(), int(capacity), num_experts)
    return l_aux, routes, exp_counts


def dense(routes: Routes) -> tuple[Tensor, Tensor]:
    """DeepSpeed's ``(combine_weights [S, E, C], dispatch_mask)`` of ``routes``."""
    k, num_tokens = routes.indices.shape
    flat = routes.num_experts * routes.capacity
    combine = routes.gates.new_zeros(num_tokens, flat + 1)
    slots = torch.where(routes.indices >= 0, routes.indices * routes.capacity + routes.locations,
                        flat)
    for r in range(k):
        combine = combine.scatter_add(1, slots[r].unsqueeze(1), routes.gates[r].unsqueeze(1))
    combine = combine[:, :flat].reshape(num_tokens, routes.num_experts, routes.capacity)
    return combine, combine.bool()


def sparse(l_aux: Tensor, routes: Routes, exp_counts: Tensor) -> tuple:
    """DeepSpeed's ``sparse_routes=True`` return value."""
    return (l_aux, torch.tensor(routes.capacity), routes.num_experts,
            routes.indices.to(torch.int32), routes.locations.to(torch.int32), routes.gates,
            exp_counts)


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int,
               used_token: Tensor | None = None, noisy_gate_policy: str | None = None,
               drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None,
               sparse_routes: bool = False, use_tutel: bool = False) -> tuple:
    """DeepSpeed's ``top1gating`` (``use_tutel`` accepted, unused)."""
    del use_tutel
    l_aux, routes, counts = route_top1(logits, capacity_factor, min_capacity, used_token,
                                       noisy_gate_policy, drop_tokens, use_rts, ep_group)
    return sparse(l_aux, routes, counts) if sparse_routes else (l_aux, *dense(routes), counts)


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int,
               drop_tokens: bool = True, ep_group: Any = None,
               top2_2nd_expert_sampling: bool = True, sparse_routes: bool = False) -> tuple:
    """DeepSpeed's ``top2gating``."""
    l_aux, routes, counts = route_top2(logits, capacity_factor, min_capacity, drop_tokens,
                                       ep_group, top2_2nd_expert_sampling)
    return sparse(l_aux, routes, counts) if sparse_routes else (l_aux, *dense(routes), counts)


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int,
               drop_tokens: bool = True, ep_group: Any = None, drop_policy: str = "probs",
               sparse_routes: bool = False) -> tuple:
    """DeepSpeed's ``topkgating``."""
    l_aux, routes, counts = route_topk(logits, k, capacity_factor, min_capacity, drop_tokens,
                                       ep_group, drop_policy)
    return sparse(l_aux, routes, counts) if sparse_routes else (l_aux, *dense(routes), counts)
