"""Dynamic batching, the plan: micro-batches built to a token budget from sample lengths.

Pure functions over sequence lengths (no torch), shared by the loader and the learning-rate
scheduler of :mod:`deepshard.data_efficiency.dynamic_batching`.

Vocabulary, DeepSpeed's: a *micro-batch* is a group of samples whose lengths add up to at
most ``max_tokens``; a *batch* (one optimizer step) is ``effective_batch_size`` consecutive
micro-batches (DeepSpeed passes ``train_batch_size``: the config's batch counts micro-batches
of up to ``max_tokens`` tokens, not sequences); a batch's *size* is its number of sequences,
and the learning rate is scaled by that size over ``effective_batch_size``.

The packing is DeepSpeed 0.19.8's ``batch_by_seqlens``, batch for batch: samples in picking
order, each micro-batch (or, with equal-size micro-batches, each group of
``effective_batch_size`` interleaved ones) the longest run that stays within the limits. Two
of its quirks are kept so that a plan begins with DeepSpeed's: a sample alone over
``max_tokens`` is dropped, and the last sample in picking order is never used. One is not:
where no micro-batch can start at a sample (``min_batch_size`` with a long neighbour),
DeepSpeed silently ends the whole epoch; here that sample is skipped and packing goes on, so
DeepSpeed's plan is a prefix of this one.
"""

from __future__ import annotations

import logging
import math
import numbers
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deepshard.errors import UsageError, UsageValueError

logger = logging.getLogger(__name__)

PICKING_ORDERS = ("dataloader", "seqlen", "random")
"""``sequence_picking_order`` values: as given, by ascending length, shuffled with the seed."""
LR_SCALING_METHODS = ("linear", "sqrt", "none")
"""``lr_scaling_method`` values (any case, and ``None`` for ``"none"``)."""
_SHOWN_IDS = 10


@dataclass(frozen=True)
class BatchPlan:
    """The batches of one epoch, as DeepSpeed's ``batch_by_seqlens`` builds them.

    Micro-batch ``j`` belongs to batch ``j // effective_batch_size``; the data-parallel rank
    ``r`` of ``R`` trains the micro-batches ``j`` with ``j % R == r``.
    """

    microbatches: tuple[tuple[int, ...], ...]
    """Sample ids of each micro-batch, in training order."""
    microbatch_tokens: tuple[int, ...]
    """Sum of the sample lengths of each micro-batch (each at most ``max_tokens``)."""
    effective_batch_size: int
    """Micro-batches per batch."""
    max_tokens: int
    """The token budget of one micro-batch."""
    batch_sizes: tuple[int, ...]
    """Sequences in each batch: what the learning rate is scaled by."""
    batch_max_seqlens: tuple[int, ...]
    """Longest sample of each batch: what samples are padded to when padding is asked."""
    too_long_ids: tuple[int, ...] = ()
    """Samples dropped because they alone exceed ``max_tokens`` (DeepSpeed drops them too)."""
    skipped_ids: tuple[int, ...] = ()
    """Samples no micro-batch could start at, with later samples packed (DeepSpeed ends the
    epoch at the first of them)."""
    leftover_ids: tuple[int, ...] = ()
    """Samples after the last micro-batch that form none (DeepSpeed leaves them out too)."""
    trimmed_ids: tuple[int, ...] = ()
    """Samples of the last micro-batches, too few to fill a batch."""

    @property
    def num_batches(self) -> int:
        """Batches (optimizer steps) in the epoch."""
        return len(self.batch_sizes)

    def microbatch_ids(self) -> list[tuple[int, list[int]]]:
        """DeepSpeed's form: ``(batch id, sample ids)`` per micro-batch."""
        size = self.effective_batch_size
        return [(j // size, list(ids)) for j, ids in enumerate(self.microbatches)]


@dataclass(frozen=True)
class BatchArithmetic:
    """One batch of a plan, counted: what a log line or a capacity check needs."""

    batch_id: int
    """Index of the batch (optimizer step) in the epoch."""
    sequences: int
    """Sequences in the batch."""
    tokens: int
    """Tokens in the batch, unpadded."""
    max_seqlen: int
    """Longest sequence of the batch."""
    micro_batches_per_rank: int
    """Micro-batches each data-parallel rank trains for this batch."""
    tokens_per_rank: tuple[int, ...]
    """Unpadded tokens each data-parallel rank trains for this batch."""
    lr_multiplier: float
    """The factor applied to the scheduler's learning rate for this batch."""


def scale_lr(base_batch_size: float, batch_size: float, base_lr: float = 1,
             method: str | None = "linear") -> float:
    """The learning rate for ``batch_size`` sequences, given ``base_lr`` for
    ``base_batch_size``: ``linear`` multiplies it by the ratio (Goyal et al.), ``sqrt`` by
    its square root (Krizhevsky), ``none`` (or ``None``) keeps it."""
    name = lr_scaling_method_name(method, where="lr_scaling_method")
    if base_batch_size <= 0:
        raise UsageValueError(f"the base batch size must be positive, not {base_batch_size}",
                              where="base_batch_size")
    # the same operations in the same order as DeepSpeed: bit-identical learning rates
    if name == "linear":
        return base_lr * batch_size / base_batch_size
    if name == "sqrt":
        return base_lr * math.sqrt(batch_size / base_batch_size)
    return base_lr


def lr_scaling_method_name(method: str | None, where: str | None = None) -> str:
    """``method`` as one of :data:`LR_SCALING_METHODS`; an unknown one is a
    :class:`UsageValueError` at ``where``."""
    name = "none" if method is None else str(method).lower()
    if name not in LR_SCALING_METHODS:
        raise UsageValueError(f"unknown learning-rate scaling method {method!r}", where=where,
                              hint=f"use one of {LR_SCALING_METHODS}")
    return name


def plan_batches(seqlens: Sequence[Any], max_tokens: int, *,
                 sequence_ids: Sequence[int] | None = None, min_batch_size: int | None = 1,
                 max_batch_size: int | None = None, sequence_picking_order: str = "dataloader",
                 effective_batch_size: int = 1, required_microbatches_of_same_size: bool = False,
                 seed: int | None = None) -> BatchPlan:
    """Pack the samples ``sequence_ids`` (all by default) of lengths ``seqlens`` into
    micro-batches of at most ``max_tokens`` tokens and ``min_batch_size`` to
    ``max_batch_size`` sequences, grouped in batches of ``effective_batch_size``.

    With ``required_microbatches_of_same_size`` the micro-batches of a batch hold the same
    number of sequences (pipeline parallelism needs it). Arguments out of range, negative or
    fractional lengths and too few samples for one batch are :class:`UsageError`\\ s. Logs
    nothing: :func:`log_plan_warnings` says what was dropped.
    """
    _check_plan_args(max_tokens, min_batch_size, max_batch_size, sequence_picking_order,
                     effective_batch_size)
    lengths = _as_lengths(seqlens)
    ids = range(len(lengths)) if sequence_ids is None else _as_ids(sequence_ids, len(lengths))
    order = [(lengths[i], i) for i in ids]
    if sequence_picking_order == "random":
        random.Random(seed).shuffle(order)  # the permutation DeepSpeed draws for this seed
    elif sequence_picking_order == "seqlen":
        order.sort()
    too_long = tuple(i for length, i in order if length > max_tokens)
    order = [item for item in order if item[0] <= max_tokens]
    multiple = effective_batch_size if required_microbatches_of_same_size else 1
    micro, skipped, leftover = _pack(order, max_tokens, min_batch_size or 0,
                                     max_batch_size or 0, multiple)
    kept = len(micro) - len(micro) % effective_batch_size
    if kept == 0:
        raise UsageError(
            f"{len(order)} samples make {len(micro)} micro-batches of at most {max_tokens} "
            f"tokens, fewer than the {effective_batch_size} of one batch",
            where="max_tokens",
            hint="use more samples, a smaller max_tokens or a smaller train_batch_size")
    return _make_plan(micro[:kept], effective_batch_size, max_tokens, too_long=too_long,
                      skipped=skipped, leftover=leftover,
                      trimmed=tuple(i for mb in micro[kept:] for _, i in mb))


def batch_by_seqlens(seqlens: Sequence[Any], max_tokens: int,
                     sequence_ids_per_mb: Sequence[int] | None = None,
                     min_batch_size: int | None = 1, max_batch_size: int | None = None,
                     sequence_picking_order: str = "dataloader", effective_batch_size: int = 1,
                     required_microbatches_of_same_size: bool = False, verbose: bool = False,
                     seed: int | None = None,
                     ) -> tuple[list[tuple[int, list[int]]], list[int], list[int]]:
    """DeepSpeed's ``batch_by_seqlens``: :func:`plan_batches` as the triple
    ``(microbatch_ids, batch_sizes, batch_max_seqlens)``, ``microbatch_ids`` being
    ``(batch id, sample ids)`` per micro-batch. Warns about dropped samples; with ``verbose``
    logs each batch's arithmetic."""
    plan = plan_batches(seqlens, max_tokens, sequence_ids=sequence_ids_per_mb,
                        min_batch_size=min_batch_size, max_batch_size=max_batch_size,
                        sequence_picking_order=sequence_picking_order,
                        effective_batch_size=effective_batch_size,
                        required_microbatches_of_same_size=required_microbatches_of_same_size,
                        seed=seed)
    log_plan_warnings(plan)
    if verbose:
        for row in plan_arithmetic(plan):
            logger.info("dynamic batching: %s", row)
    return plan.microbatch_ids(), list(plan.batch_sizes), list(plan.batch_max_seqlens)


def plan_arithmetic(plan: BatchPlan, *, dp_world_size: int = 1,
                    lr_scaling_method: str | None = "linear") -> list[BatchArithmetic]:
    """Each batch of ``plan`` counted: sequences, tokens, micro-batches and tokens per
    data-parallel rank (``dp_world_size`` of them), and the learning-rate multiplier."""
    size = plan.effective_batch_size
    if dp_world_size < 1 or size % dp_world_size:
        raise UsageError(f"{size} micro-batches per batch cannot be shared by "
                         f"{dp_world_size} data-parallel ranks", where="dp_world_size")
    rows = []
    for b, sequences in enumerate(plan.batch_sizes):
        tokens = plan.microbatch_tokens[b * size:(b + 1) * size]
        rows.append(BatchArithmetic(
            batch_id=b, sequences=sequences, tokens=sum(tokens),
            max_seqlen=plan.batch_max_seqlens[b], micro_batches_per_rank=size // dp_world_size,
            tokens_per_rank=tuple(sum(tokens[r::dp_world_size]) for r in range(dp_world_size)),
            lr_multiplier=scale_lr(size, sequences, 1.0, lr_scaling_method)))
    return rows


def plan_summary(plan: BatchPlan, *, lr_scaling_method: str | None = "linear") -> str:
    """One log line: batches, sequences per batch, token utilisation (tokens over the
    budget, ``batches * effective_batch_size * max_tokens``: ``max_tokens`` bounds each
    micro-batch), the learning-rate multipliers and the samples left out."""
    sizes = plan.batch_sizes
    capacity = plan.num_batches * plan.effective_batch_size * plan.max_tokens
    tokens = sum(plan.microbatch_tokens)
    low, high = (scale_lr(plan.effective_batch_size, s, 1.0, lr_scaling_method)
                 for s in (min(sizes), max(sizes)))
    return (f"dynamic batching: {plan.num_batches} batches of {plan.effective_batch_size} "
            f"micro-batches; sequences per batch mean {sum(sizes) / len(sizes):.1f} "
            f"min {min(sizes)} max {max(sizes)}; tokens {tokens} = {tokens / capacity:.1%} "
            f"of {plan.num_batches}x{plan.effective_batch_size}x{plan.max_tokens}; "
            f"lr x{low:.4g}..x{high:.4g} ({lr_scaling_method_name(lr_scaling_method)}); "
            f"left out: {len(plan.too_long_ids)} over max_tokens, {len(plan.skipped_ids)} "
            f"unplaceable, {len(plan.leftover_ids) + len(plan.trimmed_ids)} at the end")


def log_plan_warnings(plan: BatchPlan, log: logging.Logger = logger) -> None:
    """Warn about the samples ``plan`` dropped for their length or could not place."""
    if plan.too_long_ids:
        log.warning("dynamic batching: %d samples longer than max_tokens=%d are left out: %s",
                    len(plan.too_long_ids), plan.max_tokens, _show(plan.too_long_ids))
    if plan.skipped_ids:
        log.warning("dynamic batching: %d samples start no micro-batch within "
                    "min_batch_size/max_batch_size/max_tokens and are left out: %s",
                    len(plan.skipped_ids), _show(plan.skipped_ids))


def _pack(order: list[tuple[int, int]], max_tokens: int, min_size: int, max_size: int,
          multiple: int) -> tuple[list[list[tuple[int, int]]], tuple[int, ...], tuple[int, ...]]:
    """Greedy packing of ``(length, id)`` items: the micro-batches, the skipped ids and the
    left-over ids."""
    micro: list[list[tuple[int, int]]] = []
    unplaced: list[tuple[int, int]] = []  # (position, id)
    start, last_end = 0, 0
    while start < len(order):
        end = _longest_valid_end(order, start, max_tokens, min_size, max_size, multiple)
        if end == start:
            unplaced.append((start, order[start][1]))
            start += 1
            continue
        group = order[start:end]
        micro.extend(group[b::multiple] for b in range(multiple))
        start = last_end = end
    skipped = tuple(i for pos, i in unplaced if pos < last_end)
    return micro, skipped, tuple(i for pos, i in unplaced if pos >= last_end)


def _longest_valid_end(order: list[tuple[int, int]], start: int, max_tokens: int,
                       min_size: int, max_size: int, multiple: int) -> int:
    """The largest ``end`` such that ``order[start:end]``, dealt into ``multiple``
    interleaved micro-batches, fits every limit; ``start`` when none does."""
    tokens = [0] * multiple
    best, count, end = start, 0, start + multiple
    # validity is a range of sizes (lengths are non-negative), so the scan stops at the first
    # failure after it; `end < len(order)` is DeepSpeed's bound: the last item is never used
    while end < len(order):
        for b in range(multiple):
            tokens[b] += order[end - multiple + b][0]
        count += 1
        if (max_size and count > max_size) or max(tokens) > max_tokens:
            break
        if count >= min_size:
            best = end
        end += multiple
    return best


def _make_plan(micro: list[list[tuple[int, int]]], size: int, max_tokens: int, *,
               too_long: tuple[int, ...], skipped: tuple[int, ...], leftover: tuple[int, ...],
               trimmed: tuple[int, ...]) -> BatchPlan:
    """The plan of micro-batches of ``(length, id)`` items, ``size`` per batch."""
    batches = [micro[b:b + size] for b in range(0, len(micro), size)]
    return BatchPlan(
        microbatches=tuple(tuple(i for _, i in mb) for mb in micro),
        microbatch_tokens=tuple(sum(length for length, _ in mb) for mb in micro),
        effective_batch_size=size, max_tokens=max_tokens,
        batch_sizes=tuple(sum(len(mb) for mb in batch) for batch in batches),
        batch_max_seqlens=tuple(max(length for mb in batch for length, _ in mb)
                                for batch in batches),
        too_long_ids=too_long, skipped_ids=skipped, leftover_ids=leftover, trimmed_ids=trimmed)


def _check_plan_args(max_tokens: int, min_batch_size: int | None, max_batch_size: int | None,
                     order: str, effective_batch_size: int) -> None:
    if order not in PICKING_ORDERS:
        raise UsageError(f"unknown sequence picking order {order!r}",
                         where="sequence_picking_order", hint=f"use one of {PICKING_ORDERS}")
    for name, value in (("max_tokens", max_tokens), ("effective_batch_size", effective_batch_size)):
        if not _is_int(value) or value < 1:
            raise UsageError(f"must be a positive integer, not {value!r}", where=name)
    for name, bound in (("min_batch_size", min_batch_size), ("max_batch_size", max_batch_size)):
        if bound is not None and (not _is_int(bound) or bound < 0):
            raise UsageError(f"must be a non-negative integer, not {bound!r}", where=name)
    if min_batch_size and max_batch_size and max_batch_size < min_batch_size:
        raise UsageError(f"max_batch_size {max_batch_size} is below min_batch_size "
                         f"{min_batch_size}", where="max_batch_size")


def _as_lengths(seqlens: Sequence[Any]) -> list[int]:
    lengths = []
    for i, value in enumerate(seqlens):
        length = int(value)
        if length != value or length < 0:
            raise UsageError(f"sample {i} has length {value!r}; lengths are non-negative "
                             "integers", where="dataset_seqlens")
        lengths.append(length)
    return lengths


def _as_ids(ids: Sequence[int], count: int) -> list[int]:
    out = [int(i) for i in ids]
    bad = [i for i in out if not 0 <= i < count]
    if bad:
        raise UsageError(f"sample ids {_show(tuple(bad))} are not among the {count} samples",
                         where="dataset_filter_ids")
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _show(ids: tuple[int, ...]) -> str:
    shown = ", ".join(str(i) for i in ids[:_SHOWN_IDS])
    return f"[{shown}{', ...' if len(ids) > _SHOWN_IDS else ''}]"
