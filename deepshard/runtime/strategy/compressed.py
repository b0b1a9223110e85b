"""Stage 0 for optimizers that communicate in their own step (1-bit Adam, 0/1 Adam, 1-bit
LAMB, :mod:`deepshard.runtime.optim.onebit`).

While ``optimizer.communicates_next_step()`` says so, backward reduces nothing: each rank
keeps its own gradients and the step gets them scaled to this rank's average over its
micro-batches (the loss carried ``1 / world`` for the all-reduce that does not happen);
the optimizer's compressed all-reduce of its momentum is the step's only communication.
Otherwise (1-bit Adam's warm-up) this is plain stage 0.

In the compressed phase the averaged gradient is never formed, so the gradient norm that
clipping, fp16's overflow check and ``get_global_grad_norm`` use is the root mean square
over ranks of each rank's local norm (one scalar all-reduce), the same on every rank.

The optimizers' worker and server errors differ by rank: each rank saves its own in its
checkpoint file and takes them back at the same world size; at another world size they
start again from zero (one log line).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from deepshard.comm import collectives as comm
from deepshard.runtime.buckets import GradBuckets
from deepshard.runtime.precision import MasterWeights, global_norm
from deepshard.runtime.strategy.stage0 import Stage0Strategy

logger = logging.getLogger("deepshard")


def communicates_in_step(optimizer: object) -> bool:
    """Whether ``optimizer`` follows the 1-bit optimizers' protocol (it may do its own
    communication in ``step()``)."""
    return callable(getattr(optimizer, "communicates_next_step", None))


class LocalGradients:
    """The switch both compressed strategies share (mixed in before the strategy): while
    :meth:`local_step`, backward reduces nothing and the norm is the root mean square of
    the ranks' local norms. Needs ``optimizer``, ``world``, ``group`` and
    :meth:`gradient_buckets`."""

    optimizer: torch.optim.Optimizer
    world: int
    group: dist.ProcessGroup | None

    def gradient_buckets(self) -> GradBuckets:
        """The strategy's gradient buffers (stage 0's buckets, stage 1's flat groups)."""
        raise NotImplementedError

    def local_step(self) -> bool:
        """The coming step takes this rank's own gradients (no dense all-reduce)."""
        return self.world > 1 and bool(self.optimizer.communicates_next_step())

    def begin_backward(self, boundary: bool) -> None:
        self.gradient_buckets().begin_backward(boundary and not self.local_step())

    def end_backward(self, boundary: bool) -> None:
        buckets = self.gradient_buckets()
        buckets.end_backward()
        if boundary and not self.local_step():
            buckets.finish()

    def reduce_now(self) -> None:
        if not self.local_step():
            self.gradient_buckets().reduce_all()

    def gradient_norm(self, grads: Sequence[torch.Tensor], excluded: frozenset[int],
                      mp_group: dist.ProcessGroup | None) -> torch.Tensor:
        if not self.local_step():
            return super().gradient_norm(grads, excluded, mp_group)  # type: ignore[misc]
        sq = global_norm(grads).square()
        comm.all_reduce(sq, group=self.group)
        return (sq / self.world).sqrt()


class CompressedStage0Strategy(LocalGradients, Stage0Strategy):
    """Stage 0 whose dense all-reduce stops while the optimizer communicates itself."""

    def __init__(self, buckets: GradBuckets, masters: MasterWeights | None,
                 names: Sequence[str], optimizer: torch.optim.Optimizer):
        super().__init__(buckets, masters, names)
        self.optimizer = optimizer

    def gradient_buckets(self) -> GradBuckets:
        return self.buckets

    # -- the step ---------------------------------------------------------------------
    def unscaled_grads(self, inv_scale: float) -> list[torch.Tensor]:
        if not self.local_step():
            return super().unscaled_grads(inv_scale)
        self.buckets.unreduced = False  # stays local by design: nothing to reduce
        if self.masters is None:
            torch._foreach_mul_(self.buckets.buffers, float(self.world) * inv_scale)
            return self.buckets.buffers
        self.masters.load_grads(self.buckets.buffers, inv_scale * self.world)
        return self.masters.grad_flats

    # -- checkpoints ------------------------------------------------------------------
    def own_state(self, optimizer) -> dict:
        return {"onebit_errors": self.optimizer.error_state(), "world": self.world}

    def restore_own(self, optimizer, payload: object | None, saved_world: int) -> None:
        errors = payload.get("onebit_errors") if isinstance(payload, dict) else None
        if saved_world != self.world or errors is None:
            if dist.get_rank(self.group) == 0 and saved_world != self.world:
                logger.info("1-bit optimizer: the checkpoint was saved by %d ranks, this "
                            "job has %d: worker and server errors start from zero",
                            saved_world, self.world)
            errors = None
        self.optimizer.load_error_state(errors)
