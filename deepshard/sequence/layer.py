"""Ulysses sequence parallelism: DeepSpeed's ``DistributedAttention`` and ``_SeqAllToAll``.

Every rank of a sequence-parallel group holds ``1/P`` of the sequence (contiguous, in rank
order) for all heads. Around the local attention, an all-to-all trades that for the whole
sequence of ``~1/P`` of the heads, and a second one trades the attention's output back.
The head split is :func:`deepshard.sequence.heads.plan_heads`'s: any head count of at
least ``P`` works, unevenly split when ``P`` does not divide it, and grouped-query
attention with fewer key/value heads than ranks receives the key/value heads it needs
replicated (DeepSpeed 0.19.8 stops at both: gloo's all-to-all fails on 3 heads over 2
ranks, and an assertion on fewer key/value heads than ranks).

The exchange is one ``all_to_all_single`` over flat buffers with per-rank element counts,
inside an autograd function whose backward is the reverse exchange; the permutes and the
head selection around it are plain torch ops, so autograd differentiates them (and sums
the gradients of replicated key/value heads).

Tensors are ``[batch, seq, heads, head_dim]`` (``batch_dim_idx=0``) or
``[seq, batch, heads, head_dim]`` (``batch_dim_idx=1``), as in DeepSpeed; every rank of
the group must hold the same local sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from deepshard import comm
from deepshard.errors import UsageError
from deepshard.sequence.heads import HeadPlan, even_split, plan_heads

_plan = lru_cache(maxsize=64)(plan_heads)


class _Exchange(torch.autograd.Function):
    """``all_to_all_single`` of a flat buffer: ``send[r]`` elements to rank ``r``,
    ``recv[r]`` from it; backward is the reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, flat: Tensor, send: list[int], recv: list[int], group: Any
                ) -> Tensor:
        ctx.sizes, ctx.group = (send, recv), group
        out = flat.new_empty(sum(recv))
        comm.all_to_all_single(out, flat.contiguous(), output_split_sizes=recv,
                               input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        send, recv = ctx.sizes
        return _Exchange.apply(grad.contiguous(), recv, send, ctx.group), None, None, None


def scatter_heads(x: Tensor, counts: Sequence[int], rank: int, group: Any,
                  index: Sequence[int] | None = None) -> Tensor:
    """``[b, s/P, H, d]`` (this rank's sequence, all heads) to ``[b, s, counts[rank], d]``
    (the whole sequence, this rank's heads). Rank ``r`` gets the next ``counts[r]`` heads
    of ``x`` (or of ``x.index_select(2, index)`` when ``index`` is given)."""
    if index is not None and list(index) != list(range(x.shape[2])):
        x = x.index_select(2, torch.tensor(index, device=x.device))
    b, s, _, d = x.shape
    per_head = s * b * d
    flat = x.permute(2, 1, 0, 3).reshape(-1)  # [H, s, b, d]: each destination's heads
    mine = counts[rank]
    out = _Exchange.apply(flat, [c * per_head for c in counts],
                          [mine * per_head] * len(counts), group)
    out = out.view(len(counts), mine, s, b, d).permute(3, 0, 2, 1, 4)
    return out.reshape(b, len(counts) * s, mine, d)


def gather_heads(x: Tensor, counts: Sequence[int], rank: int, group: Any) -> Tensor:
    """The reverse of :func:`scatter_heads`: ``[b, s, counts[rank], d]`` to
    ``[b, s/P, sum(counts), d]``, heads in rank order."""
    size = len(counts)
    b, seq, mine, d = x.shape
    if seq % size:
        raise UsageError(f"the attention output has sequence length {seq}, not divisible "
                         f"by the sequence-parallel size {size}", where="DistributedAttention",
                         hint="the local attention must keep the gathered sequence length")
    s = seq // size
    flat = x.view(b, size, s, mine, d).permute(1, 3, 2, 0, 4).reshape(-1)
    per_head = s * b * d
    out = _Exchange.apply(flat, [mine * per_head] * size, [c * per_head for c in counts],
                          group)
    return out.view(sum(counts), s, b, d).permute(2, 1, 0, 3)


def _batch_first(x: Tensor, batch_dim_idx: int) -> Tensor:
    return x if batch_dim_idx == 0 else x.transpose(0, 1)


def _check_inputs(query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int) -> None:
    if batch_dim_idx not in (0, 1):
        raise UsageError(f"batch_dim_idx must be 0 or 1, got {batch_dim_idx!r}",
                         where="DistributedAttention.forward",
                         hint="0 for [batch, seq, heads, dim], 1 for [seq, batch, heads, dim]")
    shapes = [tuple(t.shape) for t in (query, key, value)]
    if any(len(s) != 4 for s in shapes) or key.shape[:3] != value.shape[:3] or \
            query.shape[:2] != key.shape[:2]:
        raise UsageError(f"query, key and value must be 4-D with the same batch and sequence "
                         f"sizes (and key, value the same heads), got {shapes}",
                         where="DistributedAttention.forward",
                         hint="pass [batch, seq/P, heads, head_dim] tensors (or seq first "
                              "with batch_dim_idx=1)")


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of the first ``cos.shape[-1]`` channels of ``t`` (DeepSpeed's)."""
    rot = cos.shape[-1]
    head, rest = t[..., :rot], t[..., rot:]
    out = head * cos + _rotate_half(head) * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


class DistributedAttention(torch.nn.Module):
    """DeepSpeed-Ulysses attention: ``local_attention`` over the whole sequence of this
    rank's heads, between two all-to-alls over ``sequence_process_group``.

    Arguments are DeepSpeed's. ``scatter_idx`` must be 2 (heads); the sequence dimension
    follows from ``batch_dim_idx`` at each call, so ``gather_idx`` only has to be 0 or 1.
    ``sp_stream`` (CUDA overlap of the exchanges) is accepted and not used. ``num_kv_heads``
    is read from ``key`` when not given.
    """

    def __init__(self, local_attention: Any, sequence_process_group: Any,
                 scatter_idx: int = 2, gather_idx: int = 0, sp_stream: Any = None,
                 num_kv_heads: int | None = None) -> None:
        super().__init__()
        if scatter_idx != 2 or gather_idx not in (0, 1):
            raise UsageError(f"scatter_idx={scatter_idx}, gather_idx={gather_idx}: heads "
                             "must be dimension 2 and the sequence dimension 0 or 1",
                             where="DistributedAttention",
                             hint="use scatter_idx=2, gather_idx=0 (DeepSpeed's defaults)")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads

    def plan(self, query_heads: int, kv_heads: int) -> HeadPlan:
        """The head split for these head counts over this group (see :mod:`.heads`)."""
        return _plan(query_heads, kv_heads, comm.get_world_size(self.spg))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int,
                rotary_pos_emb: Any = None, *args: Any, **kwargs: Any) -> Tensor:
        """``query``/``key``/``value``: this rank's sequence shard of every head; returns
        the attention output for that shard, in the same layout. ``rotary_pos_emb``:
        DeepSpeed's ``(cos, sin)``, applied to the gathered query and key; ``args`` and
        ``kwargs`` go to the local attention (masks there cover the whole sequence)."""
        _check_inputs(query, key, value, batch_dim_idx)
        size, rank = comm.get_world_size(self.spg), comm.get_rank(self.spg)
        kv = self.num_kv_heads if self.num_kv_heads is not None else key.shape[2]
        if kv != key.shape[2]:
            raise UsageError(f"num_kv_heads is {kv} but key has {key.shape[2]} heads",
                             where="DistributedAttention(num_kv_heads=...)",
                             hint="pass the model's key/value head count, or leave it out")
        plan = self.plan(query.shape[2], kv)
        q, k, v = (_batch_first(t, batch_dim_idx) for t in (query, key, value))
        if size > 1:
            q = scatter_heads(q, plan.q_counts, rank, self.spg)
            kv_counts = [len(i) for i in plan.kv_index]
            index = [h for i in plan.kv_index for h in i]
            k, v = (scatter_heads(t, kv_counts, rank, self.spg, index) for t in (k, v))
        q, k, v = (_batch_first(t, batch_dim_idx) for t in (q, k, v))
        if rotary_pos_emb is not None:
            cos, sin = (t.permute(1, 0, 2, 3) for t in rotary_pos_emb[:2])
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        if size == 1:
            return context
        return self._back(context, plan, rank, batch_dim_idx)

    def _back(self, context: Tensor, plan: HeadPlan, rank: int, batch_dim_idx: int
              ) -> Tensor:
        flat = context.dim() == 3  # [.., seq, heads * dim], as Megatron's core attention
        mine = plan.q_counts[rank]
        if flat:
            context = context.reshape(*context.shape[:2], mine, -1)
        out = gather_heads(_batch_first(context, batch_dim_idx), plan.q_counts, rank,
                           self.spg)
        out = _batch_first(out, batch_dim_idx)
        return out.reshape(*out.shape[:2], -1) if flat else out


class _SeqAllToAll:
    """DeepSpeed's ``_SeqAllToAll.apply(group, input, scatter_idx, gather_idx,
    batch_dim_idx, ...)``: with ``scatter_idx`` 2, this rank's sequence of all heads to
    the whole sequence of its heads (split as :func:`~.heads.even_split`); with
    ``scatter_idx`` 0 or 1, back. Differentiable."""

    @staticmethod
    def apply(group: Any, input: Tensor, scatter_idx: int, gather_idx: int,
              batch_dim_idx: int | None = None, *unused: Any) -> Tensor:
        if batch_dim_idx is None:  # DeepSpeed before 0.14: [seq, batch, heads, dim]
            batch_dim_idx = 1 - (gather_idx if scatter_idx >= 2 else scatter_idx)
        size, rank = comm.get_world_size(group), comm.get_rank(group)
        if size == 1:
            return input
        x = _batch_first(input, batch_dim_idx)
        if scatter_idx >= 2:
            out = scatter_heads(x, even_split(x.shape[2], size), rank, group)
        else:
            mine = torch.tensor([x.shape[2]])
            counts = [torch.zeros_like(mine) for _ in range(size)]
            comm.all_gather(counts, mine, group=group)
            out = gather_heads(x, [int(c) for c in counts], rank, group)
        return _batch_first(out, batch_dim_idx)


def single_all_to_all(input: Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int,
                      group: Any, *unused: Any, **unused_kw: Any) -> Tensor:
    """DeepSpeed's name for one exchange (see :class:`_SeqAllToAll`)."""
    return _SeqAllToAll.apply(group, input, scatter_idx, gather_idx, batch_dim_idx)
