"""Stage 0 data parallelism: gradients averaged by bucketed all-reduce launched during backward.

Each trainable parameter's ``.grad`` is a view into a flat per-bucket buffer, so autograd
accumulates straight into what gets communicated (no copy in, no copy out). A bucket's
all-reduce is launched asynchronously from the post-accumulate-grad hook of its last
parameter, while autograd goes on computing earlier layers' gradients; buckets are launched
strictly in index order so that every rank issues its collectives in the same order.
Communication happens only at gradient-accumulation boundaries (:attr:`GradBuckets.sync`).

Several backwards may run before one optimizer step (DeepSpeed accepts two
``engine.backward`` calls at one boundary): a backward that starts on buffers already
reduced first turns them back into this rank's share (:meth:`GradBuckets._rearm`), so the
next reduction sums every backward's gradients exactly once; gradients left unreduced at a
step (a backward that did not synchronise, another engine's backward reaching these
parameters) are reduced by the step itself (:attr:`GradBuckets.unreduced`).

The engine scales the loss by ``1 / world`` before backward, so the all-reduced sum is
already the mean: no division pass after communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from deepshard.comm import collectives as comm
from deepshard.errors import UsageError
from deepshard.runtime.backward import outside_error
from deepshard.runtime.hooks import weak_hook

# DDP's default bucket: big enough to amortise a collective, small enough to overlap backward.
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass(frozen=True)
class BucketLayout:
    """Which parameters (indices into the engine's parameter list) share one flat buffer."""

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype


def plan_buckets(shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype],
                 cap_elements: int) -> tuple[BucketLayout, ...]:
    """Group parameters into buckets of at most ``cap_elements`` (a bigger one gets its own).

    Parameters are taken in reverse registration order, the order backward produces their
    gradients in, so the first bucket fills first. Buckets never mix dtypes.
    """
    if cap_elements < 1:
        raise ValueError(f"bucket capacity must be positive, got {cap_elements}")
    layouts: list[BucketLayout] = []
    current: dict[torch.dtype, list[int]] = {}
    filled: dict[torch.dtype, int] = {}

    def close(dtype: torch.dtype) -> None:
        members = current.pop(dtype, [])
        if members:
            offsets, total = [], 0
            for i in members:
                offsets.append(total)
                total += shapes[i].numel()
            layouts.append(BucketLayout(tuple(members), tuple(offsets), total, dtype))
        filled[dtype] = 0

    for i in reversed(range(len(shapes))):
        n, dtype = shapes[i].numel(), dtypes[i]
        if current.get(dtype) and filled[dtype] + n > cap_elements:
            close(dtype)
        current.setdefault(dtype, []).append(i)
        filled[dtype] = filled.get(dtype, 0) + n
    for dtype in list(current):
        close(dtype)
    return tuple(layouts)


class GradBuckets:
    """Owns the flat gradient buffers of ``params`` and all-reduces them over ``group``.

    Args:
        params: the trainable parameters, in registration order.
        layouts: from :func:`plan_buckets` over the same parameters.
        group: the data-parallel process group (``None``: the default group).
        world: its size; with 1, nothing is communicated.
        comm_dtype: dtype on the wire; ``None`` keeps each bucket's own dtype.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], layouts: Sequence[BucketLayout],
                 group: dist.ProcessGroup | None, world: int,
                 comm_dtype: torch.dtype | None = None, names: Sequence[str] = ()):
        self.params = list(params)
        self.names = tuple(names) or tuple(f"parameter {i}" for i in range(len(self.params)))
        self.layouts = tuple(layouts)
        self.group, self.world, self.comm_dtype = group, world, comm_dtype
        device = self.params[0].device if self.params else torch.device("cpu")
        self.buffers = [torch.zeros(b.numel, dtype=b.dtype, device=device) for b in self.layouts]
        self.views: list[torch.Tensor | None] = [None] * len(self.params)
        for b, layout in enumerate(self.layouts):
            for i, off in zip(layout.params, layout.offsets, strict=True):
                p = self.params[i]
                self.views[i] = self.buffers[b][off:off + p.numel()].view_as(p)
        self.sync = False
        self._active = False
        self._armed = False
        self._reduced = False  # the buffers hold reduced gradients (since the last zero)
        self.unreduced = False  # local gradients arrived since the last reduction
        self._ready = [False] * len(self.params)
        self._pending: list[int] = []
        self._next = 0
        self._works: list[tuple[Any, torch.Tensor, int]] = []  # (Work, wire, bucket)
        self._hooks = []
        bucket_of = {i: b for b, layout in enumerate(self.layouts) for i in layout.params}
        for i, p in enumerate(self.params):
            p.grad = self.views[i]
            self._hooks.append(p.register_post_accumulate_grad_hook(
                weak_hook(self._on_grad, i, bucket_of[i])))
        self._reset_counts()

    def rebind_views(self) -> None:
        """Point the per-parameter gradient views (each parameter's ``.grad``) at the
        buffers' current storage, after the buffers moved (``engine.offload_states``)."""
        for b, layout in enumerate(self.layouts):
            buf = self.buffers[b]
            for i, off in zip(layout.params, layout.offsets, strict=True):
                view = cast(torch.Tensor, self.views[i])
                view.set_(buf.untyped_storage(), buf.storage_offset() + off, view.shape)

    def _reset_counts(self) -> None:
        self._pending = [len(layout.params) for layout in self.layouts]
        self._ready = [False] * len(self.params)
        self._next = 0

    def begin_backward(self, sync: bool) -> None:
        """Called by the engine before each backward: ``sync`` at an accumulation boundary,
        when this backward's gradients are to be reduced (every rank reduces every bucket)."""
        if self._reduced:
            self._rearm()
        self.sync, self._active = sync, True
        self._armed = self._armed or sync

    def _rearm(self) -> None:
        """The buffers were reduced and more gradients are coming: make them this rank's
        share of the reduced sum again (the loss was scaled by ``1 / world``, so the sum
        over ranks of ``buffer / world`` is the buffer)."""
        self._reduced = False
        self.unreduced = True
        if self.world > 1 and self.buffers:
            torch._foreach_mul_(self.buffers, 1.0 / self.world)

    def end_backward(self) -> None:
        """Called by the engine after each backward."""
        self._active = False

    def _on_grad(self, param: torch.Tensor, i: int, b: int) -> None:
        if not self._active:
            raise outside_error(self.names[i])
        self.unreduced = True
        view = cast(torch.Tensor, self.views[i])  # hooked parameters have one
        if param.grad is not view:
            # the user set grads to None (optimizer.zero_grad()): put them back in the bucket
            grad = param.grad
            # a sparse gradient (Embedding(sparse=True)) is reduced dense, as DeepSpeed
            # 0.19.8's result is: the same sum
            view.copy_(grad.to_dense() if grad.is_sparse else grad)
            param.grad = view
        if not self.sync:
            return
        if self._ready[i]:
            raise UsageError(f"{self.names[i]} got its gradient twice in one backward",
                             where="engine.backward",
                             hint="use torch.utils.checkpoint with use_reentrant=False, and "
                                  "do not reuse a parameter across reentrant checkpoints")
        self._ready[i] = True
        self._pending[b] -= 1
        while self._next < len(self.layouts) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        if self.world == 1:
            return
        buf = self.buffers[b]
        wire = buf if self.comm_dtype in (None, buf.dtype) else buf.to(self.comm_dtype)
        work = comm.all_reduce(wire, group=self.group, async_op=True)
        self._works.append((work, wire, b))

    def finish(self) -> None:
        """Wait until every bucket is reduced (launching those whose grads never came).

        Does nothing unless a synchronising backward ran since the last call, so calling it
        twice never reduces the same gradients twice.
        """
        if not self._armed:
            return
        self._armed = False
        while self._next < len(self.layouts):
            self._launch(self._next)
            self._next += 1
        for work, wire, b in self._works:
            work.wait()
            if wire is not self.buffers[b]:
                self.buffers[b].copy_(wire)
        self._works.clear()
        self._reset_counts()
        self._reduced, self.unreduced = True, False

    def reduce_all(self) -> None:
        """Reduce every bucket now and wait (after backwards that did not synchronise: the
        pipeline engine reduces once its last micro-batch's backward and the tied-weight
        sums are done)."""
        self._armed = True
        self.finish()

    def zero(self) -> None:
        """Zero every gradient (in place: the grads stay views into the buckets)."""
        for i, p in enumerate(self.params):
            p.grad = self.views[i]
        if self.buffers:
            torch._foreach_zero_(self.buffers)
        self._reduced = self.unreduced = False

    def nbytes(self) -> int:
        """Bytes held in gradient buffers."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def remove(self) -> None:
        """Unregister the hooks (the engine is being torn down)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
