"""Megatron-style tensor parallelism over an explicit process group.

The four *region* functions move activations between the replicated world (every rank of
the tensor-parallel group holds the same tensor) and the sharded one (each rank holds a
slice of the last dimension), with the matching gradient collective in backward:

=====================  ==========================  ===============================
function               forward                     backward
=====================  ==========================  ===============================
copy_to_region         identity                    all-reduce (sum)
reduce_from_region     all-reduce (sum)            identity
gather_from_region     all-gather the last dim     keep this rank's slice
scatter_to_region      keep this rank's slice      all-gather the last dim
=====================  ==========================  ===============================

On top of them: :class:`ColumnParallelLinear` (output features split),
:class:`RowParallelLinear` (input features split, outputs summed),
:class:`VocabParallelEmbedding` (vocabulary rows split) and
:func:`vocab_parallel_cross_entropy` (the loss over vocabulary-sharded logits, never
gathering them). Each layer builds itself from a dense ``nn.Linear`` / ``nn.Embedding``
with ``from_dense`` so that a tensor-parallel run starts from exactly the dense weights,
and reports how its parameters are split (``shard_specs``); :func:`tp_layout` collects
those for a whole model and :func:`gather_full_state_dict` assembles the dense state dict.

``group`` is always passed explicitly. ``None`` means a group of one (this process holds
everything and nothing is communicated) — not torch's default world group. A group of
size one communicates nothing either.
"""

from __future__ import annotations

from typing import TypeAlias

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from deepshard.errors import UsageError
from deepshard.runtime.parallel.tp_shards import (
    ShardSpec,
    check_divisible,
    merge_shards,
    shard_tensor,
)

Group: TypeAlias = dist.ProcessGroup | None  # None: the default group


def tp_world_size(group: Group) -> int:
    """Number of ranks in the tensor-parallel group (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def tp_rank(group: Group) -> int:
    """This process's rank inside the tensor-parallel group (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """The reduction into a new tensor (``x`` may be saved for backward elsewhere)."""
    if tp_world_size(group) == 1:
        return x.view_as(x)
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    return out


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = tp_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = tp_world_size(group)
    if world == 1:
        return x
    if x.shape[-1] % world:
        raise UsageError(f"the last dimension ({x.shape[-1]}) does not split evenly over "
                         f"{world} tensor-parallel ranks", where="scatter_to_region",
                         hint="make the feature size a multiple of the tensor-parallel size")
    return x.chunk(world, dim=-1)[tp_rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a sharded region with a replicated ``x``: identity forward, gradient summed
    over the group in backward (each rank's slice of the work contributes to it)."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a sharded region by summing partial results over the group; identity
    backward."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate every rank's last-dimension slice in rank order; backward keeps this
    rank's slice of the gradient."""
    return _GatherFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of a replicated ``x``'s last dimension; backward all-gathers
    the gradient."""
    return _ScatterToRegion.apply(x, group)


class _Shared:
    """Holds the process group of a layer: copies of the layer (``copy.deepcopy`` of a
    model) share it, since a process group cannot be copied."""

    __slots__ = ("value",)

    def __init__(self, value: Group):
        self.value = value

    def __deepcopy__(self, memo) -> _Shared:
        return self


class _TPLayer(nn.Module):
    """What the tensor-parallel layers share: their group."""

    _group: _Shared

    @property
    def group(self) -> Group:
        """The tensor-parallel process group (``None``: a group of one)."""
        return self._group.value


def _init_uniform(tensor: torch.Tensor, fan_in: int) -> None:
    """nn.Linear's default distribution, with the *dense* layer's fan-in."""
    bound = 1.0 / fan_in ** 0.5 if fan_in > 0 else 0.0
    nn.init.uniform_(tensor, -bound, bound)


class ColumnParallelLinear(_TPLayer):
    """``y = x Aᵀ + b`` with ``A``'s output rows split: rank ``r`` holds
    ``weight [out/T, in]`` (and ``bias [out/T]``) and produces its slice of ``y``.

    Args:
        in_features, out_features, bias: as for ``nn.Linear`` (the dense sizes).
        group: the tensor-parallel process group (``None``: a group of one).
        gather_output: all-gather the output so every rank holds the full ``y``;
            otherwise the output stays sharded for a following :class:`RowParallelLinear`.
        sections: sizes of fused sections of the output (e.g. ``(d, d, d)`` for a fused
            qkv), each split separately so a rank holds whole heads of each.

    A fresh layer draws its shard from nn.Linear's distribution with this process's RNG;
    use :meth:`from_dense` to start from a dense layer's exact weights.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 group: Group = None, gather_output: bool = False, *,
                 sections: tuple[int, ...] = (), device=None, dtype=None):
        super().__init__()
        where = f"ColumnParallelLinear({in_features}, {out_features})"
        world = tp_world_size(group)
        if sections and sum(sections) != out_features:
            raise UsageError(f"sections {list(sections)} do not add up to out_features "
                             f"{out_features}", where=where,
                             hint="give the sizes of the fused outputs (e.g. q, k, v)")
        if gather_output and len(sections) > 1:
            raise UsageError("gather_output with fused sections would return them in rank "
                             "order, not the dense layout", where=where,
                             hint="gather_output=False (the usual choice before a row-"
                                  "parallel layer), or no sections")
        self.spec = ShardSpec(0, tuple(sections))
        check_divisible(where, out_features, self.spec, world)
        self.in_features, self.out_features = in_features, out_features
        self._group, self.gather_output = _Shared(group), gather_output
        local = self.spec.local_size(out_features, world)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(local, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(local, **kw)) if bias else None
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_uniform(self.weight, self.in_features)
        if self.bias is not None:
            _init_uniform(self.bias, self.in_features)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: Group, *, gather_output: bool = False,
                   sections: tuple[int, ...] = (), name: str = "linear"
                   ) -> ColumnParallelLinear:
        """This rank's shard of ``linear`` (weights copied, ``linear`` left untouched).
        ``name`` appears in errors."""
        layer = _build(cls, name, linear.in_features, linear.out_features,
                       linear.bias is not None, group, gather_output, sections=sections,
                       device="meta", dtype=linear.weight.dtype)
        rank, world = tp_rank(group), tp_world_size(group)
        layer.weight = _shard_param(linear.weight, layer.spec, rank, world, name)
        if linear.bias is not None:
            layer.bias = _shard_param(linear.bias, layer.spec, rank, world, name)
        return layer

    def shard_specs(self) -> dict[str, ShardSpec]:
        """How each of this layer's parameters is split (by local parameter name)."""
        return {"weight": self.spec} | ({"bias": self.spec} if self.bias is not None else {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_region(x, self.group), self.weight, self.bias)
        return gather_from_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.weight.shape[0]}), bias={self.bias is not None}, "
                f"tp={tp_world_size(self.group)}, gather_output={self.gather_output}"
                + (f", sections={list(self.spec.sections)}" if self.spec.sections else ""))


class RowParallelLinear(_TPLayer):
    """``y = x Aᵀ + b`` with ``A``'s input columns split: rank ``r`` holds
    ``weight [out, in/T]``, computes a partial ``y`` from its slice of ``x``, the partials
    are all-reduced, and the (replicated) ``bias [out]`` is added once, after the sum.

    Args:
        in_features, out_features, bias: as for ``nn.Linear`` (the dense sizes).
        group: the tensor-parallel process group (``None``: a group of one).
        input_is_parallel: ``x`` is already this rank's slice (the output of a
            :class:`ColumnParallelLinear` without gather); otherwise ``x`` is replicated
            and the layer takes its slice itself.

    A fresh layer's bias starts at zero (it must be equal on every rank); use
    :meth:`from_dense` to start from a dense layer's exact weights.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 group: Group = None, input_is_parallel: bool = True, *,
                 device=None, dtype=None):
        super().__init__()
        self.spec = ShardSpec(1)
        world = tp_world_size(group)
        check_divisible(f"RowParallelLinear({in_features}, {out_features})", in_features,
                        self.spec, world)
        self.in_features, self.out_features = in_features, out_features
        self._group, self.input_is_parallel = _Shared(group), input_is_parallel
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // world, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_uniform(self.weight, self.in_features)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: Group, *, input_is_parallel: bool = True,
                   name: str = "linear") -> RowParallelLinear:
        """This rank's shard of ``linear`` (weights copied, ``linear`` left untouched).
        ``name`` appears in errors."""
        layer = _build(cls, name, linear.in_features, linear.out_features,
                       linear.bias is not None, group, input_is_parallel, device="meta",
                       dtype=linear.weight.dtype)
        layer.weight = _shard_param(linear.weight, layer.spec, tp_rank(group),
                                    tp_world_size(group), name)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(),
                                      requires_grad=linear.bias.requires_grad)
        return layer

    def shard_specs(self) -> dict[str, ShardSpec]:
        """How each of this layer's parameters is split; the bias is replicated."""
        return {"weight": self.spec}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group)
        y = reduce_from_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"tp={tp_world_size(self.group)}, input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(_TPLayer):
    """An embedding table with its rows (the vocabulary) split: rank ``r`` holds rows
    ``r*V/T:(r+1)*V/T``, looks up the ids it owns, writes zeros for the others, and the
    results are all-reduced — so the output is the dense lookup on every rank.

    Args:
        num_embeddings, embedding_dim, padding_idx: as for ``nn.Embedding``.
        group: the tensor-parallel process group (``None``: a group of one).

    Ids outside ``[0, num_embeddings)`` raise, as ``nn.Embedding`` does.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group = None,
                 padding_idx: int | None = None, *, device=None, dtype=None):
        super().__init__()
        self.spec = ShardSpec(0)
        world = tp_world_size(group)
        check_divisible(f"VocabParallelEmbedding({num_embeddings}, {embedding_dim})",
                        num_embeddings, self.spec, world)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._group, self.padding_idx = _Shared(group), padding_idx
        self.vocab_start = tp_rank(group) * (num_embeddings // world)
        self.weight = nn.Parameter(torch.empty(num_embeddings // world, embedding_dim,
                                               device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        local_pad = self._local_padding_idx()
        if local_pad is not None:
            with torch.no_grad():
                self.weight[local_pad].zero_()

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group: Group, *,
                   name: str = "embedding") -> VocabParallelEmbedding:
        """This rank's rows of ``embedding`` (copied, ``embedding`` left untouched)."""
        unsupported = [opt for opt, on in (("max_norm", embedding.max_norm is not None),
                                           ("scale_grad_by_freq", embedding.scale_grad_by_freq),
                                           ("sparse", embedding.sparse)) if on]
        if unsupported:
            raise UsageError(f"a vocabulary-parallel embedding does not support "
                             f"{', '.join(unsupported)}", where=name,
                             hint="keep this embedding replicated")
        layer = _build(cls, name, embedding.num_embeddings, embedding.embedding_dim, group,
                       embedding.padding_idx, device="meta", dtype=embedding.weight.dtype)
        layer.weight = _shard_param(embedding.weight, layer.spec, tp_rank(group),
                                    tp_world_size(group), name)
        return layer

    def shard_specs(self) -> dict[str, ShardSpec]:
        """How each of this layer's parameters is split (by local parameter name)."""
        return {"weight": self.spec}

    def _local_padding_idx(self) -> int | None:
        local = None if self.padding_idx is None else self.padding_idx - self.vocab_start
        return local if local is not None and 0 <= local < self.weight.shape[0] else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if bool(((ids < 0) | (ids >= self.num_embeddings)).any()):
            raise UsageError(f"token ids must lie in [0, {self.num_embeddings})",
                             where="VocabParallelEmbedding",
                             hint="check the tokenizer's vocabulary size against the model's")
        foreign = (ids < self.vocab_start) | (ids >= self.vocab_start + self.weight.shape[0])
        local = (ids - self.vocab_start).masked_fill(foreign, 0)
        out = F.embedding(local, self.weight, self._local_padding_idx())
        return reduce_from_region(out.masked_fill(foreign.unsqueeze(-1), 0.0), self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (local rows "
                f"{self.vocab_start}:{self.vocab_start + self.weight.shape[0]}), "
                f"tp={tp_world_size(self.group)}"
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""))


def _build(cls, name: str, *args, **kwargs):
    """``cls(*args)``, with a split error naming the model's layer instead of the class."""
    try:
        return cls(*args, **kwargs)
    except UsageError as exc:
        raise UsageError(exc.message, where=f"{name} ({exc.where})", hint=exc.hint) from None


def _shard_param(full: torch.Tensor, spec: ShardSpec, rank: int, world: int,
                 name: str) -> nn.Parameter:
    return nn.Parameter(shard_tensor(full.detach(), spec, rank, world, name),
                        requires_grad=full.requires_grad)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        vocab_local = logits.shape[-1]
        x = logits.reshape(-1, vocab_local).float()
        target = target.reshape(-1)
        x = x - _all_reduce(x.max(dim=-1).values, group, dist.ReduceOp.MAX).unsqueeze(-1)
        start = tp_rank(group) * vocab_local
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < start + vocab_local)
        local = (target - start).masked_fill(~mine, 0)
        rows = torch.arange(x.shape[0], device=x.device)
        target_logit = _all_reduce(x[rows, local].masked_fill(~mine, 0.0), group)
        exp = x.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        losses = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        count = valid.sum()
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), mine, local, valid, count)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return (losses.sum() / count).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, local, valid, count = ctx.saved_tensors
        scale = valid.to(softmax.dtype) * (grad.float() / count)
        out = softmax * scale.unsqueeze(-1)  # not in place: backward may run again
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        out[rows, local] -= mine.to(out.dtype) * scale
        return out.reshape(ctx.logits_shape).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor,
                                 group: Group, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of logits sharded over the vocabulary, without gathering them.

    ``logits_shard [..., V/T]`` is this rank's slice of the logits (the output of a
    :class:`ColumnParallelLinear` head without gather: rank ``r`` holds classes
    ``r*V/T:(r+1)*V/T``); ``target [...]`` holds class ids in ``[0, V)`` or
    ``ignore_index``. Equal to ``F.cross_entropy(full_logits.flatten(0, -2),
    target.flatten(), ignore_index=ignore_index)`` (mean over non-ignored targets; NaN when
    all are ignored), computed in fp32 and returned in the logits' dtype, on every rank.
    Costs three all-reduces of ``[N]`` floats.
    """
    if logits_shard.shape[:-1] != target.shape:
        raise UsageError(f"target shape {list(target.shape)} does not match the logits' "
                         f"leading dimensions {list(logits_shard.shape[:-1])}",
                         where="vocab_parallel_cross_entropy",
                         hint="the classes must be the last dimension of the logits")
    vocab = logits_shard.shape[-1] * tp_world_size(group)
    if bool((((target < 0) | (target >= vocab)) & (target != ignore_index)).any()):
        raise UsageError(f"targets must lie in [0, {vocab}) or equal ignore_index "
                         f"({ignore_index})", where="vocab_parallel_cross_entropy",
                         hint="check the targets against the model's vocabulary size")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, group, ignore_index)


def tp_layout(model: nn.Module) -> dict[str, ShardSpec]:
    """``state_dict`` name -> :class:`ShardSpec` of every tensor-parallel parameter in
    ``model`` (names not listed are replicated). Reads the model only."""
    layout = {}
    for prefix, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear,
                               VocabParallelEmbedding)):
            for name, spec in module.shard_specs().items():
                layout[f"{prefix}.{name}" if prefix else name] = spec
    return layout


def gather_full_state_dict(model: nn.Module, group: Group) -> dict[str, torch.Tensor]:
    """The dense model's state dict, assembled on every rank of ``group`` from the
    tensor-parallel ``model``'s shards (a collective: every rank of the group must call
    it). Keys are ``model.state_dict()``'s; tensors are detached."""
    layout, world = tp_layout(model), tp_world_size(group)
    full = {}
    for name, value in model.state_dict().items():
        if name in layout and world > 1:
            value = value.detach().contiguous()
            parts = [torch.empty_like(value) for _ in range(world)]
            dist.all_gather(parts, value, group=group)
            value = merge_shards(parts, layout[name])
        full[name] = value.detach()
    return full
