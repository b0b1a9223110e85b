"""The tensor-parallel layers of inference: what an AutoTP plan's modules become.

Inference needs no autograd, so these are plain modules over ``torch.distributed``
collectives, unlike the training layers of :mod:`deepshard.runtime.parallel.tensor`; they
add what generation needs: a vocabulary that does not divide by the tensor-parallel size
(GPT-2's 50,257: each rank holds ``ceil(V / T)`` rows, the last padded with zeros, and the
gathered logits are cut back to ``V``) and int8 weights (:meth:`ShardedLinear.quantize_int8`).

Every rank of the group computes the same output: a row-parallel layer all-reduces its
partial sums (gloo's and NCCL's all-reduce leave the same bits on every rank), a
column-parallel one that gathers concatenates every rank's columns, and a vocabulary-parallel
embedding all-reduces rows only one rank holds. The parameters keep the dense module's
names (``weight``, ``bias``), so a state dict of a sharded model has the dense keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from deepshard.inference.collectives import TPComm

if TYPE_CHECKING:
    from deepshard.inference.quant import Int8Kernel

LinearKind = Literal["column", "row", "replicate"]
_ALONE = TPComm(None, 1, 0, None)


class ShardedLinear(nn.Module):
    """This rank's part of a Linear (or of HF's ``Conv1D``, stored as a Linear).

    ``column``: ``weight`` holds this rank's output rows (per fused section), the output is
    this rank's columns, all-gathered when ``gather_output``; ``row``: ``weight`` holds this
    rank's input columns, the partial products are all-reduced, then the (whole) bias
    added; ``replicate``: the whole Linear on every rank (a layer AutoTP leaves whole, or
    every Linear at tensor-parallel size 1, so that int8 applies to it too).
    """

    def __init__(self, kind: LinearKind, in_features: int, out_features: int,
                 local_shape: tuple[int, int], bias: bool, comm: TPComm = _ALONE, *,
                 gather_output: bool = False, input_is_parallel: bool = True,
                 rank: int = 0, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.kind = kind
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output
        self.input_is_parallel = input_is_parallel
        self.rank = rank
        self.comm = comm
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(local_shape, **kw), requires_grad=False)
        width = local_shape[0] if kind == "column" else out_features
        self.bias = nn.Parameter(torch.empty(width, **kw), requires_grad=False) if bias else None
        self._kernel: Int8Kernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "row" and not self.input_is_parallel:
            width = self.weight.shape[1]
            x = x[..., self.rank * width:(self.rank + 1) * width]
        alone = self.kind == "row" and self.comm.world == 1
        add_bias = self.bias if self.kind != "row" or alone else None
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # 2-D: one addmm, as HF's Conv1D does
        y = self._kernel(x) if self._kernel is not None else F.linear(x, self.weight, add_bias)
        y = y.view(*lead, y.shape[-1])
        if self.kind == "row" and not alone:
            y = self.comm.all_reduce(y)
            return y if self.bias is None else y + self.bias
        if self.kind == "column" and self.gather_output:
            y = self.comm.all_gather_last(y)
        return y[..., :self.out_features] if y.shape[-1] > self.out_features else y

    @property
    def is_int8(self) -> bool:
        """Whether the weight is held in int8 (:meth:`quantize_int8`)."""
        return self._kernel is not None

    def quantize_int8(self, kernel: str = "auto") -> None:
        """Hold the weight as int8 with one fp32 scale per output row (symmetric, per
        channel: ZeroQuant's weight quantization) and compute with :class:`Int8Kernel`.
        ``weight`` becomes an int8 buffer and ``weight_scale`` is added, so the state dict
        stays loadable; the bias stays in floating point."""
        from deepshard.inference.quant import Int8Kernel, quantize_per_channel

        q = quantize_per_channel(self.weight.detach())
        bias = self.bias.detach() if self.bias is not None and self.kind != "row" else None
        self._kernel = Int8Kernel.build(q, bias, kernel=kernel)
        del self.weight
        self.register_buffer("weight", q.qweight)
        self.register_buffer("weight_scale", q.scale)

    def extra_repr(self) -> str:
        local = tuple(self.weight.shape)
        return (f"{self.kind}, in={self.in_features}, out={self.out_features}, local={local}"
                f"{', gather_output' if self.gather_output else ''}"
                f"{', int8 ' + self._kernel.name if self._kernel is not None else ''}")


class VocabShardedEmbedding(nn.Module):
    """Rows ``[rank * R, rank * R + R)`` of a token embedding, ``R = ceil(V / T)`` (rows
    past ``V`` are zero padding, never looked up); a token's row comes from the one rank
    holding it, through an all-reduce."""

    def __init__(self, num_embeddings: int, embedding_dim: int, rows: int,
                 comm: TPComm = _ALONE, *,
                 rank: int = 0, padding_idx: int | None = None, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.start = rank * rows
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, device=device, dtype=dtype),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world == 1:
            return F.embedding(ids, self.weight)
        rows = self.weight.shape[0]
        outside = (ids < self.start) | (ids >= self.start + rows)
        out = F.embedding((ids - self.start).clamp(0, rows - 1), self.weight)
        return self.comm.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows {self.start}.."
                f"{self.start + self.weight.shape[0]}")
