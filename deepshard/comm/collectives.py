"""Collectives with DeepSpeed's signatures, over torch.distributed.

Each takes DeepSpeed's extra keywords: ``prof`` (record this call even when the logger
profiles only some ops), ``log_name`` (the name it is recorded under) and ``debug``
(accepted and unused: the caller's name is found when the logger's ``debug`` is on). They
return what torch returns (a work handle with ``async_op=True``, else ``None``). ``op`` is
a ``torch.distributed.ReduceOp`` (also exported as ``deepshard.comm.ReduceOp``); an enum
member of the same name (DeepSpeed's own ``ReduceOp``) is accepted too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from deepshard.comm.timed import timed_op

ReduceOp = dist.ReduceOp
SUM = ReduceOp.SUM
# torch 2.13 renamed these (the old names warn); torch >= 2.4 has the old ones
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_op(op: Any) -> Any:
    """``op`` as torch's ReduceOp (an enum member is looked up by its name)."""
    if isinstance(op, ReduceOp) or not hasattr(op, "name"):
        return op
    return getattr(ReduceOp, op.name)


class CoalescedWork:
    """The works of a coalesced call as one handle; ``wait()`` also runs ``finish``."""

    def __init__(self, works: Sequence[Any], finish: Any = None):
        self.works, self.finish = list(works), finish

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _finish(work: CoalescedWork, async_op: bool) -> CoalescedWork | None:
    if async_op:
        return work
    work.wait()
    return None


# ---- reductions ---------------------------------------------------------------------------

@timed_op
def all_reduce(tensor, op=SUM, group=None, async_op=False, prof=False,
               log_name="all_reduce", debug=None):
    return dist.all_reduce(tensor, op=reduce_op(op), group=group, async_op=async_op)


@timed_op
def inference_all_reduce(tensor, op=SUM, group=None, async_op=False, prof=False,
                         log_name="all_reduce", debug=None):
    """A blocking all-reduce (DeepSpeed's shared-memory CPU kernel is not here); returns
    ``tensor`` itself in a world of one, as DeepSpeed does."""
    if dist.get_world_size(group) <= 1:
        return tensor
    return dist.all_reduce(tensor, op=reduce_op(op), group=group, async_op=False)


@timed_op
def all_reduce_coalesced(tensors, op=SUM, group=None, async_op=False, prof=False,
                         log_name="all_reduce", debug=None):
    """All-reduce a list of tensors with one collective per dtype (flattened)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    flats = {dtype: torch.cat([t.reshape(-1) for t in ts]) for dtype, ts in by_dtype.items()}
    works = [dist.all_reduce(flat, op=reduce_op(op), group=group, async_op=True)
             for flat in flats.values()]

    def unflatten() -> None:
        for dtype, ts in by_dtype.items():
            offset = 0
            for t in ts:
                t.copy_(flats[dtype][offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    return _finish(CoalescedWork(works, unflatten), async_op)


@timed_op
def reduce(tensor, dst, op=SUM, group=None, async_op=False, prof=False, log_name="reduce",
           debug=None):
    return dist.reduce(tensor, dst, op=reduce_op(op), group=group, async_op=async_op)


@timed_op
def reduce_scatter(output, input_list, op=SUM, group=None, async_op=False, prof=False,
                   log_name="reduce_scatter", debug=None):
    return dist.reduce_scatter(output, input_list, op=reduce_op(op), group=group,
                               async_op=async_op)


@timed_op
def reduce_scatter_tensor(output_tensor, tensor, op=SUM, group=None, async_op=False,
                          prof=False, log_name="reduce_scatter_tensor", debug=None):
    return _scatter_single(output_tensor, tensor, op=reduce_op(op), group=group,
                           async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=SUM, group=None, async_op=False, prof=False,
                      debug=None):
    """DeepSpeed's name: :func:`reduce_scatter_tensor` (recorded under that name)."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op,
                                 prof=prof, debug=debug)


# ---- gathers and broadcasts ---------------------------------------------------------------

@timed_op
def broadcast(tensor, src, group=None, async_op=False, prof=False, log_name="broadcast",
              debug=None):
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


@timed_op
def broadcast_object_list(object_list, src, group=None, device=None, prof=False,
                          log_name="broadcast_object_list", debug=None):
    return dist.broadcast_object_list(object_list, src, group=group, device=device)


@timed_op
def all_gather(tensor_list, tensor, group=None, async_op=False, prof=False,
               log_name="all_gather", debug=None):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


@timed_op
def all_gather_object(object_list, obj, group=None, prof=False, log_name="all_gather_object",
                      debug=None):
    return dist.all_gather_object(object_list, obj, group=group)


@timed_op
def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, prof=False,
                           log_name="all_gather_into_tensor", debug=None):
    return _gather_single(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    """DeepSpeed's name: :func:`all_gather_into_tensor` (recorded under that name)."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op,
                                  debug=debug)


def all_gather_coalesced(output_tensors, input_tensors, group=None, async_op=False):
    """``all_gather_into_tensor`` of each (output, input) pair, as one handle."""
    if len(output_tensors) != len(input_tensors):
        raise ValueError(f"all_gather_coalesced: {len(output_tensors)} outputs for "
                         f"{len(input_tensors)} inputs")
    works = [all_gather_into_tensor(out, inp, group=group, async_op=True)
             for out, inp in zip(output_tensors, input_tensors, strict=True)]
    return _finish(CoalescedWork(works), async_op)


@timed_op
def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, prof=False,
           log_name="gather", debug=None):
    return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


@timed_op
def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, prof=False,
            log_name="scatter", debug=None):
    return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


@timed_op
def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False, prof=False, log_name="all_to_all_single",
                      debug=None):
    return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group,
                                  async_op=async_op)


@timed_op
def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, prof=False,
               log_name="all_to_all", debug=None):
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group,
                           async_op=async_op)


# ---- barriers -----------------------------------------------------------------------------

@timed_op
def barrier(group=None, async_op=False, device_ids=None, prof=False, log_name="barrier",
            debug=None):
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


@timed_op
def monitored_barrier(group=None, timeout=None, wait_all_ranks=False, prof=False,
                      log_name="monitored_barrier", debug=None):
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
