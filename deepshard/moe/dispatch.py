"""Tokens to their experts and back: all-to-all over the expert-parallel group.

DeepSpeed pads every expert's buffer to the capacity ``C`` and exchanges the whole
``[E, C, M]`` block (and for dropless routing first agrees on ``C``, the largest count over
the group, with an all-reduce). Here only routed tokens travel: the ranks first exchange
their per-expert counts (``E`` integers), then the tokens with uneven splits, so a
rank sends ``routed * M`` elements instead of ``E * C * M``, a dropped or unrouted slot
costs nothing, and dropless routing needs no agreement on a capacity. Every rank always
joins both exchanges, also with zero-length splits, so an expert or a rank that receives
no tokens never hangs its peers. On the expert side the received tokens are regrouped by
local expert and padded locally to the largest local count, so the experts run as one
grouped matmul (:meth:`~deepshard.moe.experts.Experts.grouped`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from deepshard.comm.collectives import all_to_all_single
from deepshard.moe.gating import Routes


class _AllToAll(torch.autograd.Function):
    """DeepSpeed's equal-split all-to-all (its ``sharded_moe._AllToAll``)."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor) -> Tensor:
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[None, Tensor]:
        return None, _AllToAll.apply(ctx.group, *grad_output)


class AllToAllV(torch.autograd.Function):
    """All-to-all of rows with uneven splits; its gradient goes back the same way."""

    @staticmethod
    def forward(ctx: Any, group: Any, rows: Tensor, out_splits: list[int],
                in_splits: list[int]) -> Tensor:
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        return exchange(group, rows, out_splits, in_splits)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:
        out_splits, in_splits = ctx.splits
        return None, AllToAllV.apply(ctx.group, grad, in_splits, out_splits), None, None


def exchange(group: Any, rows: Tensor, out_splits: list[int], in_splits: list[int]) -> Tensor:
    """``rows`` split by ``in_splits`` to the group's ranks; returns what arrives."""
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group,
                           log_name="moe_all_to_all")
    return out


@dataclass(frozen=True)
class Plan:
    """One forward's routing, in the order tokens travel.

    Attributes:
        tokens: ``[N]`` source token of each kept route, sorted by expert.
        gates: ``[N]`` its combine weight.
        send: rows sent to each expert-parallel rank.
        recv: rows received from each.
        to_local: ``[N_recv]`` received row of each row in local-expert-major order.
        slots: ``[L * width]`` row of the padded ``[L, width]`` buffer each slot reads
            (``N_recv`` = the zero pad row).
        rows: ``[N_recv]`` slot of each local-expert-major row.
        width: the largest count among the local experts (the padded buffer's width).
        local_counts: rows each local expert received.
    """

    tokens: Tensor
    gates: Tensor
    send: list[int]
    recv: list[int]
    to_local: Tensor
    slots: Tensor
    rows: Tensor
    width: int
    local_counts: list[int]


def plan(routes: Routes, ep_size: int, group: Any) -> Plan:
    """Sort the kept routes by expert and agree with the group on the counts."""
    k, num_tokens = routes.indices.shape
    experts = routes.indices.reshape(-1)
    kept = torch.nonzero(experts >= 0).squeeze(1)
    order = kept[torch.sort(experts[kept], stable=True)[1]]
    counts = torch.bincount(experts[order], minlength=routes.num_experts)
    local = routes.num_experts // ep_size
    device = experts.device
    if ep_size > 1:
        arrived = exchange(group, counts, [local] * ep_size, [local] * ep_size)
    else:
        arrived = counts
    arrived = arrived.view(ep_size, local)
    # received rows are source-rank major; the experts want them local-expert major
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=device).repeat(ep_size),
                                            arrived.reshape(-1))
    to_local = torch.sort(expert_of_row, stable=True)[1]
    per_expert = arrived.sum(dim=0)
    width = int(per_expert.max()) if local else 0
    starts = torch.cumsum(per_expert, dim=0) - per_expert
    sorted_expert = expert_of_row[to_local]
    position = torch.arange(len(to_local), device=device) - starts[sorted_expert]
    rows = sorted_expert * width + position
    slots = torch.full((local * width,), len(to_local), dtype=torch.long, device=device)
    slots[rows] = torch.arange(len(to_local), device=device)
    token_of = torch.arange(num_tokens, device=device).repeat(k)
    return Plan(token_of[order], routes.gates.reshape(-1)[order],
                counts.view(ep_size, local).sum(dim=1).tolist(), arrived.sum(dim=1).tolist(),
                to_local, slots, rows, width, per_expert.tolist())


def dispatch(x: Tensor, p: Plan, ep_size: int, group: Any) -> Tensor:
    """``[S, M]`` tokens to the padded ``[L, width, M]`` buffer of the local experts."""
    rows = x.index_select(0, p.tokens)
    if ep_size > 1:
        rows = AllToAllV.apply(group, rows, p.recv, p.send)
    rows = rows.index_select(0, p.to_local)
    padded = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    local = len(p.local_counts)
    return padded.index_select(0, p.slots).view(local, p.width, rows.shape[1])


def combine(y: Tensor, p: Plan, num_tokens: int, ep_size: int, group: Any) -> Tensor:
    """The experts' ``[L, width, H]`` outputs back to ``[S, H]``, weighted by the gates
    (accumulated in fp32 as DeepSpeed does, then cast back to ``y``'s dtype)."""
    width_rows = y.reshape(-1, y.shape[-1]).index_select(0, p.rows)
    back = torch.empty_like(p.to_local)
    back[p.to_local] = torch.arange(len(p.to_local), device=back.device)
    rows = width_rows.index_select(0, back)
    if ep_size > 1:
        rows = AllToAllV.apply(group, rows, p.send, p.recv)
    weighted = rows * p.gates.unsqueeze(1)
    out = weighted.new_zeros(num_tokens, y.shape[-1]).index_add(0, p.tokens, weighted)
    return out.to(y.dtype)
