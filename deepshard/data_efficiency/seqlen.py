"""The sequence-length curriculum metrics, applied to a collated batch.

Megatron-DeepSpeed's convention: a ``single_cluster`` metric named ``seqlen_truncate`` cuts
every sequence of the batch to the current difficulty, one named ``seqlen_reshape`` folds
each sequence into rows of that length (the same tokens in shorter, more numerous rows).
:func:`post_process` is what deepshard does to each batch when the user sets no
post-process function (DeepSpeed's ``post_process_func(batch, sampler.state_dict())``).

Which tensors are sequences: the batch's sequence length is dim 1 of its first tensor with
at least two dims (``input_ids`` first in a mapping that has it, then in order, depth
first); a *sequence tensor* is a tensor of at least two dims whose dim 1 equals it, e.g.
``input_ids``, ``attention_mask``, ``labels``, ``position_ids`` of ``[b, s]``, or hidden
inputs of ``[b, s, h]``. Other tensors (``[b]`` labels, a ``[b, 1, s, s]`` mask) and other
values are left as they are by truncation; see :func:`reshape` for what it does to them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

SEQLEN_TRUNCATE = "seqlen_truncate"
SEQLEN_RESHAPE = "seqlen_reshape"


def sequence_length(batch: Any) -> int | None:
    """The batch's sequence length (see the module's rule), ``None`` without one."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[1]) if batch.dim() >= 2 else None
    if isinstance(batch, Mapping):
        values = list(batch.values())
        if isinstance(batch.get("input_ids"), torch.Tensor):
            values.insert(0, batch["input_ids"])
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        return None
    for value in values:
        found = sequence_length(value)
        if found is not None:
            return found
    return None


def truncate(batch: Any, seqlen: int) -> Any:
    """``batch`` with every sequence tensor cut to its first ``seqlen`` positions
    (contiguous copies); unchanged when its sequences are not longer."""
    length = sequence_length(batch)
    if length is None or seqlen >= length:
        return batch

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[:, :seqlen].contiguous() if _is_sequence(t, length) else t

    return _map_tensors(batch, cut)


def reshape(batch: Any, seqlen: int) -> Any:
    """``batch`` with each sequence folded into rows of ``seqlen``: a ``[b, s, ...]``
    sequence tensor becomes ``[b * (s // seqlen), seqlen, ...]`` (the last ``s % seqlen``
    positions of each sequence are dropped), row ``i * (s // seqlen) + j`` holding part
    ``j`` of sample ``i``. Every other tensor whose dim 0 is the batch size is repeated
    per part (``repeat_interleave``), so each new row keeps its sample's values; other
    values are left as they are. Unchanged when the sequences are not longer."""
    length = sequence_length(batch)
    if length is None or seqlen >= length:
        return batch
    parts = length // seqlen
    rows = _batch_size(batch, length)

    def fold(t: torch.Tensor) -> torch.Tensor:
        if _is_sequence(t, length):
            kept = t[:, :parts * seqlen]
            return kept.reshape(t.shape[0] * parts, seqlen, *t.shape[2:])
        if t.dim() >= 1 and t.shape[0] == rows:
            return t.repeat_interleave(parts, dim=0)
        return t

    return _map_tensors(batch, fold)


def post_process(batch: Any, sampler_state: Mapping[str, Any]) -> Any:
    """Apply the seqlen metrics of ``sampler_state["current_difficulties"]`` (the
    sampler's :meth:`~deepshard.data_efficiency.sampler.CurriculumSampler.state_dict`) to
    ``batch``: ``seqlen_truncate``, then ``seqlen_reshape``; other metrics change nothing."""
    difficulties = sampler_state.get("current_difficulties") or {}
    if SEQLEN_TRUNCATE in difficulties:
        batch = truncate(batch, int(difficulties[SEQLEN_TRUNCATE]))
    if SEQLEN_RESHAPE in difficulties:
        batch = reshape(batch, int(difficulties[SEQLEN_RESHAPE]))
    return batch


def _is_sequence(t: torch.Tensor, length: int) -> bool:
    return bool(t.dim() >= 2 and t.shape[1] == length)


def _batch_size(batch: Any, length: int) -> int:
    found: list[int] = []

    def note(t: torch.Tensor) -> torch.Tensor:
        if not found and _is_sequence(t, length):
            found.append(int(t.shape[0]))
        return t

    _map_tensors(batch, note)
    return found[0]


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` rebuilt with ``fn`` applied to each tensor (mappings, lists, tuples and
    named tuples keep their type where it can be rebuilt from its items)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {key: _map_tensors(value, fn) for key, value in batch.items()}
        if type(batch) is dict:
            return items
        rebuild: Any = type(batch)
        try:
            return rebuild(items)  # e.g. transformers' BatchEncoding
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map_tensors(value, fn) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_tensors(value, fn) for value in batch)
    return batch
