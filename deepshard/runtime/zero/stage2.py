"""ZeRO stage 2: gradients reduce-scattered into their shards during backward.

No full gradient buffer survives a backward. When a parameter's gradient is final (its
post-accumulate-grad hook), it is copied into its flat group's *staging* buffer and the
parameter's ``.grad`` is dropped; once every member of a group has arrived, the staging
buffer is reduce-scattered in place (``comm.reduce_into_shard``: all-reduced on gloo),
asynchronously, while autograd goes on. Groups are launched strictly in plan order (a
ready group waits for the ones before it), so every rank issues the same collectives in
the same order even when ranks use different parameters. Completed reductions are added
into the rank's gradient shard (accumulating over micro-batches, as DeepSpeed's stage 2
does: it reduces at every micro-step), and the staging buffer goes back to a small pool
(``overlap_comm``: two buffers, else one), which is emptied at the end of each backward.

Stage 3 uses the same machinery, with a callback telling it when a group's gradients are
all staged, so that it can release the group's gathered parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from deepshard.errors import UsageError
from deepshard.runtime.backward import outside_error
from deepshard.runtime.hooks import weak_hook
from deepshard.runtime.zero.comm import reduce_by_all_reduce, reduce_into_shard
from deepshard.runtime.zero.flat import FlatGroup
from deepshard.runtime.zero.qgz import QuantizedReduce, quantized_reduce_into_shard


class StagingPool:
    """Reusable staging buffers of ``capacity`` elements per dtype (``depth`` of them);
    beyond that, temporary ones."""

    def __init__(self, capacity: int, depth: int, device: torch.device):
        self.capacity, self.depth, self.device = capacity, depth, device
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}
        self._made: dict[torch.dtype, int] = {}
        self._ours: set[int] = set()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A buffer of ``numel`` elements, or ``None`` when the pool is exhausted."""
        if numel > self.capacity:
            return torch.empty(numel, dtype=dtype, device=self.device)
        free = self._free.setdefault(dtype, [])
        if free:
            return free.pop()[:numel]
        if self._made.get(dtype, 0) < self.depth:
            self._made[dtype] = self._made.get(dtype, 0) + 1
            base = torch.empty(self.capacity, dtype=dtype, device=self.device)
            self._ours.add(id(base))
            return base[:numel]
        return None

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer obtained from :meth:`take` (temporary ones are just dropped)."""
        base = buf._base if buf._base is not None else buf
        if id(base) in self._ours:
            self._free.setdefault(buf.dtype, []).append(base)

    def clear(self) -> None:
        """Drop every pooled buffer (between steps the pool holds nothing)."""
        self._free.clear()
        self._made.clear()
        self._ours.clear()


class Stage2Grads:
    """Gradient shards of ``groups`` filled by reduce-scatter during every backward."""


    def __init__(self, params: Sequence[torch.nn.Parameter], groups: Sequence[FlatGroup],
                 pg: dist.ProcessGroup | None, world: int, comm_dtype: torch.dtype | None,
                 names: Sequence[str], overlap_comm: bool, bucket_elements: int,
                 on_complete: Callable[[int], None] | None = None,
                 qgz: QuantizedReduce | None = None):
        self.params = list(params)
        self.qgz = qgz
        """ZeRO++ qgZ: reduce through quantized all-to-alls (:mod:`.qgz`) instead."""
        self.groups = list(groups)
        self.names = tuple(names)
        self.pg, self.world, self.comm_dtype = pg, world, comm_dtype
        self.on_complete = on_complete
        self.all_reduce = world > 1 and reduce_by_all_reduce(pg)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.shards = [torch.zeros(g.spec.shard, dtype=g.dtype, device=device)
                       for g in self.groups]
        largest = max((g.spec.padded for g in self.groups), default=0)
        self.pool = StagingPool(min(max(bucket_elements, 1), largest) or 1,
                                2 if overlap_comm else 1, device)
        self.group_of: dict[int, tuple[int, int]] = {}
        for gi, g in enumerate(self.groups):
            for i, off in zip(g.flat.params, g.flat.offsets, strict=True):
                self.group_of[i] = (gi, off)
        self._staging: list[torch.Tensor | None] = [None] * len(self.groups)
        self._pending = [len(g.params) for g in self.groups]
        self._next = 0  # the next group to launch, in plan order
        self._seen = [False] * len(self.params)
        self._works: list[tuple[Any, torch.Tensor, torch.Tensor, int]] = []
        self._active = False
        self._passive = False
        # gradients left in .grad by passive backwards, reduced by the next backward's
        # hooks or by the step (reduce_all)
        self.unreduced = False
        self._hooks = [p.register_post_accumulate_grad_hook(weak_hook(self._on_grad, i))
                       for i, p in enumerate(self.params) if i in self.group_of]

    # the engine's side -------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        """Called before each backward (every backward reduces at stage 2)."""
        del sync
        self._active = True

    def begin_passive(self) -> None:
        """Another engine's backward reaches these parameters: their gradients stay in
        ``.grad`` (a module's own ``zero_grad()`` drops them, as in plain torch) until this
        engine's next backward or step reduces them."""
        self._active = self._passive = True

    def end_backward(self) -> None:
        """Called after each backward: reduce what never got a gradient, wait for all."""
        self._active = False
        if self._passive:
            self._passive = False
            return
        self.finish()

    def finish_backward(self, boundary: bool) -> None:
        """After autograd: every backward reduced during itself; fold the results."""
        del boundary
        self.end_backward()

    def reduce_all(self) -> None:
        """Reduce the gradients passive backwards left in ``.grad`` (at a step)."""
        self.unreduced = False
        self._active = True
        try:
            for i, p in enumerate(self.params):
                if p.grad is not None and i in self.group_of:
                    self._on_grad(p, i)
        finally:
            self._active = False
        self.finish()

    def abort_backward(self) -> None:
        """Called when backward raised: drop what was staged, launch nothing more."""
        self._active = False
        while self._works:
            self._fold_oldest()
        self._reset()

    def finish(self) -> None:
        """Launch the remaining groups in plan order (missing gradients count as zero) and
        fold every reduction into the shards."""
        while self._next < len(self.groups):
            self._launch(self._next)
        while self._works:
            self._fold_oldest()
        self._reset()

    def _reset(self) -> None:
        self._staging = [None] * len(self.groups)
        self._pending = [len(g.params) for g in self.groups]
        self._seen = [False] * len(self.params)
        self._next = 0
        self.pool.clear()

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's averaged gradient shard of every group."""
        return self.shards

    def zero(self) -> None:
        """Zero the gradient shards."""
        if self.shards:
            torch._foreach_zero_(self.shards)
        for p in self.params:
            p.grad = None
        self.unreduced = False

    def nbytes(self) -> int:
        """Bytes of gradient shards held between steps."""
        return sum(s.numel() * s.element_size() for s in self.shards)

    def remove(self) -> None:
        """Unregister the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # hooks ---------------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor, i: int) -> None:
        if not self._active:
            raise outside_error(self.names[i])
        if self._passive:
            self.unreduced = True
            return
        if self._seen[i]:
            raise UsageError(f"{self.names[i]} got its gradient twice in one backward",
                             where="engine.backward",
                             hint="use torch.utils.checkpoint with use_reentrant=False, and "
                                  "do not reuse a parameter across reentrant checkpoints")
        self._seen[i] = True
        gi, off = self.group_of[i]
        grad = param.grad
        if grad.is_sparse:  # Embedding(sparse=True): reduced dense
            grad = grad.to_dense()
        g = self.groups[gi]
        if self._staging[gi] is None and len(g.params) == 1 and grad.is_contiguous() \
                and grad.numel() == g.spec.padded and grad.dtype == g.dtype:
            self._staging[gi] = grad.view(-1)  # a group of one: reduced in place, no copy
        else:
            self._staging_of(gi)[off:off + grad.numel()].copy_(grad.reshape(-1))
        param.grad = None
        self._pending[gi] -= 1
        while self._next < len(self.groups) and self._pending[self._next] == 0:
            self._launch(self._next)

    def _staging_of(self, gi: int) -> torch.Tensor:
        buf = self._staging[gi]
        if buf is None:
            g = self.groups[gi]
            buf = self.pool.take(g.spec.padded, g.dtype)
            while buf is None and self._works:
                self._fold_oldest()
                buf = self.pool.take(g.spec.padded, g.dtype)
            if buf is None:
                buf = torch.empty(g.spec.padded, dtype=g.dtype, device=g.device)
            buf[g.flat.numel:].zero_()  # padding reduces as zeros
            self._staging[gi] = buf
        return buf

    def _launch(self, gi: int) -> None:
        g, staging = self.groups[gi], self._staging_of(gi)
        if self._pending[gi]:  # members that got no gradient this backward reduce as zeros
            for i, off, n in zip(g.flat.params, g.flat.offsets, g.flat.numels, strict=True):
                if not self._seen[i]:
                    staging[off:off + n].zero_()
        self._staging[gi] = None
        self._pending[gi] = 0
        self._next = gi + 1
        wire = staging if self.comm_dtype in (None, staging.dtype) \
            else staging.to(self.comm_dtype)
        work = None
        if self.world > 1 and self.qgz is not None:
            quantized_reduce_into_shard(wire, g.lo, g.hi, self.qgz)
        elif self.world > 1:
            work = reduce_into_shard(wire, g.lo, g.hi, self.pg, self.all_reduce)
        self._works.append((work, wire, staging, gi))
        # a group bigger than the pool's buffers (a whole stage 3 unit) stages in a buffer
        # of its own: fold as we go, or every such buffer would live to the end of backward
        while len(self._works) > self.pool.depth:
            self._fold_oldest()
        if self.on_complete is not None:
            self.on_complete(gi)

    def _fold_oldest(self) -> None:
        work, wire, staging, gi = self._works.pop(0)
        if work is not None:
            work.wait()
        g = self.groups[gi]
        self.shards[gi].add_(wire[g.lo:g.hi])
        self.pool.give(staging)
