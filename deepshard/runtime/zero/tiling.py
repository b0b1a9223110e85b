"""DeepSpeed's ``TiledLinear``: one large linear layer as a grid of smaller ones.

``TiledLinear(in_features, out_features, in_splits=I, out_splits=O)`` holds ``O x I``
``nn.Linear`` tiles: tile ``(o, i)`` maps input slice ``i`` to output slice ``o`` (slices
as even as ``partition_uniform`` makes them), and only the last input tile of each row has
a bias. The forward sums each row's tiles and concatenates the rows, so the result equals
the plain ``nn.Linear`` whose weight the tiles cut up (:meth:`TiledLinear.copy_params_from`
copies one in). Under ZeRO-3 each tile is a module of its own, gathered and released on
its own: a layer too large to gather whole is used a tile at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from deepshard.errors import UsageValueError
from deepshard.runtime.parallel.partition import partition_uniform
from deepshard.runtime.zero.init import GatheredParameters

__all__ = ["TiledLinear", "TiledLinearReturnBias", "split_tensor_along_last_dim"]


def split_tensor_along_last_dim(tensor: torch.Tensor, partitions: Sequence[int],
                                contiguous_split_chunks: bool = False
                                ) -> tuple[torch.Tensor, ...]:
    """``tensor`` cut along its last dimension into pieces of the sizes ``partitions``
    (Megatron's helper); ``contiguous_split_chunks`` makes each piece contiguous."""
    chunks = torch.split(tensor, list(partitions), dim=tensor.dim() - 1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


class TiledLinear(nn.Module):
    """A drop-in ``nn.Linear(in_features, out_features, bias)`` split into
    ``out_splits x in_splits`` tiles (see the module docstring).

    Args:
        input_is_already_split: ``forward`` receives the ``in_splits`` input pieces
            rather than one tensor.
        combine_out_splits: concatenate the output pieces (else return the list).
        linear_cls: the class of each tile, called as ``linear_cls(in, out, bias=...,
            **kwargs)``.
        init_linear: a linear layer whose parameters to copy in.

    Raises:
        UsageValueError: a split count outside ``1..features``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 in_splits: int = 1, out_splits: int = 1,
                 input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: type[nn.Module] = nn.Linear, init_linear: nn.Module | None = None,
                 **kwargs: Any):
        super().__init__()
        for name, splits, features in (("in_splits", in_splits, in_features),
                                       ("out_splits", out_splits, out_features)):
            if not 1 <= splits <= features:
                raise UsageValueError(f"{name}={splits} is outside 1..{features}",
                                      where="TiledLinear",
                                      hint="split a dimension into at most as many tiles "
                                           "as it has features")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = list(partition_uniform(in_features, in_splits))
        self.out_parts = list(partition_uniform(out_features, out_splits))
        self.linears = nn.ModuleList(
            nn.ModuleList(
                linear_cls(self.in_parts[i + 1] - self.in_parts[i],
                           self.out_parts[o + 1] - self.out_parts[o],
                           bias=bias and i == in_splits - 1, **kwargs)
                for i in range(in_splits))
            for o in range(out_splits))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Any) -> Any:
        """Each output piece: the sum of its row's tiles over the input pieces; the pieces
        concatenated along the last dimension unless ``combine_out_splits`` is off."""
        if self.in_splits == 1:
            inputs = [input_]
        elif self.input_is_already_split:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise UsageValueError(f"got {len(inputs)} input pieces for {self.in_splits} "
                                      "input splits", where="TiledLinear.forward",
                                      hint="pass one piece per input split")
        else:
            parts = partition_uniform(input_.shape[-1], self.in_splits)
            inputs = list(self._split_global_input(
                input_, [parts[p + 1] - parts[p] for p in range(self.in_splits)]))
        outputs: list[Any] = []
        for row in self.linears:
            out = None
            for in_id, tile in enumerate(row):
                out = self._reduce_local_output(in_id=in_id, out_id=len(outputs),
                                                current_out=out, new_out=tile(inputs[in_id]))
            outputs.append(out)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input_: torch.Tensor, split_sizes: list[int]) -> Any:
        """The input cut into the tiles' pieces (a subclass may take other input types)."""
        return split_tensor_along_last_dim(input_, split_sizes)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any,
                             new_out: Any) -> Any:
        """``current_out`` (None for the first tile of a row) plus one tile's output."""
        del in_id, out_id
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        """The rows' outputs joined along the last dimension."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Cut ``other``'s ``weight`` (``out_features x in_features``) and ``bias`` into
        the tiles. Under ZeRO-3 each tile is gathered, written by data-parallel rank 0
        and scattered back (a collective call).

        Raises:
            UsageValueError: ``other``'s shapes or bias do not match this layer's.
        """
        weight, bias = getattr(other, "weight", None), getattr(other, "bias", None)
        if weight is None or tuple(weight.shape) != (self.out_features, self.in_features) \
                or (bias is not None) != self.use_bias or (
                    bias is not None and tuple(bias.shape) != (self.out_features,)):
            raise UsageValueError(
                "the layer to copy from has another shape or bias", where="TiledLinear."
                "copy_params_from", hint=f"give a Linear({self.in_features}, "
                f"{self.out_features}, bias={self.use_bias})")
        for o, row in enumerate(self.linears):
            rows = slice(self.out_parts[o], self.out_parts[o + 1])
            for i, tile in enumerate(row):
                cols = slice(self.in_parts[i], self.in_parts[i + 1])
                with GatheredParameters(tile.weight, modifier_rank=0):
                    tile.weight.copy_(weight[rows, cols])
            last = row[-1]
            if last.bias is not None:
                with GatheredParameters(last.bias, modifier_rank=0):
                    last.bias.copy_(cast(torch.Tensor, bias)[rows])


class TiledLinearReturnBias(TiledLinear):
    """:class:`TiledLinear` over tiles that return ``(output, bias)`` (Megatron's linear
    layers, built with ``linear_cls``): the outputs are summed as above, each row's bias
    passed through, and ``forward`` returns ``(output, bias)`` (``bias`` None when no tile
    returned one)."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any,
                             new_out: Any) -> Any:
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        tensor, bias = new_out
        tensor = super()._reduce_local_output(in_id, out_id, old_tensor, tensor)
        return tensor, old_bias if bias is None else bias

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        tensor = super()._combine_output_splits([t for t, _ in outputs])
        biases = [b for _, b in outputs if b is not None]
        return tensor, super()._combine_output_splits(biases) if biases else None
