"""ZeRO stage 1: optimizer state (and fp32 masters) sharded; gradients kept whole.

Gradients accumulate, as at stage 0, straight into full flat buffers (each parameter's
``.grad`` is a view); at an accumulation boundary each group's buffer is reduce-scattered
*in place* from the post-accumulate-grad hook of its last parameter, overlapping the rest
of backward, so that this rank's slice holds the averaged gradients of its shard
(``comm.reduce_into_shard``: an all-reduce on gloo, where that is the faster collective).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from deepshard.runtime.buckets import BucketLayout, GradBuckets
from deepshard.runtime.zero.comm import reduce_by_all_reduce, reduce_into_shard
from deepshard.runtime.zero.flat import FlatGroup


class Stage1Grads(GradBuckets):
    """Full gradient buffers, one per flat group, reduce-scattered at boundaries."""

    def __init__(self, params: Sequence[torch.nn.Parameter], groups: Sequence[FlatGroup],
                 pg: dist.ProcessGroup | None, world: int,
                 comm_dtype: torch.dtype | None = None, names: Sequence[str] = ()):
        self.groups = list(groups)
        layouts = [BucketLayout(g.flat.params, g.flat.offsets, g.spec.padded, g.dtype)
                   for g in self.groups]
        super().__init__(params, layouts, pg, world, comm_dtype, names)
        self.all_reduce = world > 1 and reduce_by_all_reduce(pg)

    def begin_passive(self) -> None:
        """Another engine's backward reaches these parameters: they accumulate."""
        self.begin_backward(False)

    def finish_backward(self, boundary: bool) -> None:
        """After autograd: at a boundary, wait for the reductions it launched."""
        self.end_backward()
        if boundary:
            self.finish()

    def abort_backward(self) -> None:
        """Autograd raised: stop accepting gradients (nothing was staged apart)."""
        self.end_backward()

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's slice of every group's (reduced) gradients."""
        return [buf[g.lo:g.hi] for buf, g in zip(self.buffers, self.groups, strict=True)]

    def _rearm(self) -> None:
        """Reduced buffers are whole only in this rank's shard (the rest is stale local
        data): keep the shard (the averaged gradients) and zero the rest, so the next
        reduce-scatter adds the new backward's gradients to it exactly once."""
        self._reduced = False
        self.unreduced = True
        if self.world == 1:
            return
        for buf, g in zip(self.buffers, self.groups, strict=True):
            buf[:g.lo].zero_()
            buf[g.hi:].zero_()

    def _launch(self, b: int) -> None:
        if self.world == 1:
            return
        buf, g = self.buffers[b], self.groups[b]
        wire = buf if self.comm_dtype in (None, buf.dtype) else buf.to(self.comm_dtype)
        work = reduce_into_shard(wire, g.lo, g.hi, self.group, self.all_reduce)
        self._works.append((work, wire, b))
