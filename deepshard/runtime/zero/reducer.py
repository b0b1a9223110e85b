"""The interface of a ZeRO stage's gradient reduction: :class:`GradientReducer`.

Stage 1 (:class:`~deepshard.runtime.zero.stage1.Stage1Grads`: whole gradient buffers,
reduce-scattered at accumulation boundaries) and stages 2-3
(:class:`~deepshard.runtime.zero.stage2.Stage2Grads`: each gradient reduced into its shard
during backward) implement it; :class:`~deepshard.runtime.zero.runtime.ZeroStrategy` drives
either without knowing which.
"""

from __future__ import annotations

from typing import Protocol

import torch


class GradientReducer(Protocol):
    """What the ZeRO strategy calls around each backward and at each step."""

    unreduced: bool
    """Gradients were left unreduced (a backward outside an accumulation boundary, or a
    passive one): the step reduces them first."""

    def begin_backward(self, sync: bool) -> None:
        """Before this engine's backward; ``sync``: at an accumulation boundary."""

    def begin_passive(self) -> None:
        """Another engine's backward reaches these parameters."""

    def finish_backward(self, boundary: bool) -> None:
        """After autograd returned: every reduction this backward owes is complete."""

    def abort_backward(self) -> None:
        """Autograd raised: drop what was staged, launch nothing more."""

    def reduce_all(self) -> None:
        """Reduce every gradient still unreduced (at a step)."""

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient shard of every flat group."""

    def zero(self) -> None:
        """Zero the gradients for the next accumulation."""

    def nbytes(self) -> int:
        """Bytes of gradient buffers held."""

    def remove(self) -> None:
        """Unregister every hook."""
