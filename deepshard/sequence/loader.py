"""Batches for sequence parallelism: each rank of a group takes ``1/P`` of a batch's tokens.

:func:`shard_batch` is the one rule (ALST's): ``labels`` become ``shift_labels`` (each
position's next-token label, ``-100`` past the end) *before* the split, since the last
token of one rank's shard predicts the first of the next rank's; ``position_ids`` are the
global positions (made with ``arange`` when the batch has none), so rotary embeddings on
a shard are the whole sequence's; then every tensor is cut along the sequence (dim 1)
into ``P`` contiguous pieces. :class:`UlyssesSPDataLoaderAdapter` is ALST's loader
adapter with DeepSpeed's arguments and behaviour: each rank's loader yields its own
batches; the adapter gathers the group's ``P`` batches and yields them one after the
other, sharded, so ``P`` of its steps consume what ``P`` data-parallel ranks would in one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from deepshard.errors import UsageError
from deepshard.sequence.loss import IGNORE_INDEX


def shard_batch(batch: Mapping[str, Any], sp_rank: int, sp_size: int) -> dict[str, Any]:
    """This rank's shard of ``batch`` (see the module docstring); non-tensors are kept.

    Raises:
        UsageError: no ``input_ids``, a sequence length not divisible by ``sp_size``, or a
            tensor whose dim 1 is not the sequence.
    """
    if "input_ids" not in batch:
        raise UsageError(f"a sequence-parallel batch needs input_ids, got keys "
                         f"{sorted(batch)}", where="shard_batch",
                         hint="yield dicts with input_ids (labels, position_ids optional)")
    out = dict(batch)
    ids = out["input_ids"]
    b, seq = ids.shape[:2]
    if seq % sp_size:
        raise UsageError(f"sequence length {seq} is not divisible by the sequence-parallel "
                         f"size {sp_size}", where="shard_batch",
                         hint=f"pad the batch to a multiple of {sp_size} tokens (labels "
                              "-100 on the padding)")
    if "labels" in out:
        labels = out.pop("labels")
        out["shift_labels"] = torch.nn.functional.pad(labels, (0, 1),
                                                      value=IGNORE_INDEX)[..., 1:]
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(seq, device=ids.device).expand(b, seq)
    chunk = seq // sp_size
    for key, value in out.items():
        if not torch.is_tensor(value):
            continue
        if value.dim() < 2 or value.shape[1] != seq:
            raise UsageError(f"batch[{key!r}] has shape {tuple(value.shape)}, but dim 1 of "
                             f"every tensor must be the sequence ({seq})",
                             where="shard_batch", hint="leave other tensors out of the batch")
        out[key] = value[:, chunk * sp_rank:chunk * (sp_rank + 1)].contiguous()
    return out


class UlyssesSPDataLoaderAdapter:
    """ALST's adapter around a data loader yielding dict batches ``[batch, seq, ...]``
    (DeepSpeed's arguments). ``len()`` is ``len(dl) * sp_world_size``."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int,
                 device: Any) -> None:
        self.dl, self.sp_rank, self.sp_group = dl, sp_rank, sp_group
        self.sp_world_size, self.device = sp_world_size, device
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Gather the group's next batches and queue this rank's shard of each."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts on the next call
            raise
        for one in gather_batches(batch, self.sp_group, self.sp_world_size, self.device):
            self.micro_batches.append(shard_batch(one, self.sp_rank, self.sp_world_size))


def gather_batches(batch: Mapping[str, Any], group: Any, size: int, device: Any
                   ) -> list[dict[str, Any]]:
    """Every rank's ``batch`` of the group, in rank order (tensors of any sequence length:
    padded for the all-gather, cut back after)."""
    shapes = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
    ids = batch["input_ids"]
    dist.all_gather(shapes, torch.tensor(ids.shape[:2], dtype=torch.int64), group=group)
    lengths = [cast(tuple[int, int], tuple(int(x) for x in s)) for s in shapes]
    longest = max(s for _, s in lengths)
    batches: list[dict[str, Any]] = [{} for _ in range(size)]
    for key, value in batch.items():
        if torch.is_tensor(value):
            parts = _gather_tensor(value.to(device), lengths, longest, group, key)
        else:
            parts = [None] * size
            dist.all_gather_object(parts, value, group=group)
        for one, part in zip(batches, parts, strict=True):
            one[key] = part
    return batches


def _gather_tensor(value: Tensor, lengths: list[tuple[int, int]], longest: int, group: Any,
                   key: str) -> list[Tensor]:
    batch_sizes = [b for b, _ in lengths]
    if len(set(batch_sizes)) != 1 or value.dim() < 2 or value.shape[0] != batch_sizes[0]:
        raise UsageError(f"batch[{key!r}] has shape {tuple(value.shape)}; the ranks of the "
                         f"sequence-parallel group hold batches of sizes {batch_sizes}",
                         where="UlyssesSPDataLoaderAdapter",
                         hint="use drop_last=True so that every batch has the same size, "
                              "and only [batch, seq, ...] tensors")
    padded = value.new_zeros((value.shape[0], longest, *value.shape[2:]))
    padded[:, :value.shape[1]] = value
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded, group=group)
    return [p[:, :s] for p, (_, s) in zip(parts, lengths, strict=True)]
