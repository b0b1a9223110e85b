"""The step skeleton every deepshard optimizer shares.

torch's optimizers each open ``step(closure)`` the same way: evaluate the closure with
gradients on, then update the parameters with gradients off, then return the closure's loss.
:class:`StepOptimizer` writes that opening once; a subclass supplies only the update,
:meth:`StepOptimizer._take_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from deepshard.kernels.lamb import LOW_PRECISION

__all__ = ["StepOptimizer"]


class StepOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose :meth:`step` runs the closure and then
    :meth:`_take_step`.

    It defines no ``__init__`` and no state, so a class may list it before another torch
    optimizer (``class TorchAdam(StepOptimizer, torch.optim.Adam)``): the step comes from
    here, everything else from that optimizer. torch wraps each concrete class's ``step``
    in its hook runner when the first instance is made, as for any optimizer.
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient; returns ``closure()`` (called
        with gradients enabled, before the update) if given, else ``None``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._take_step()
        return loss

    def _take_step(self) -> None:
        """The update itself, run under ``torch.no_grad()`` once the closure has run."""
        raise NotImplementedError(f"{type(self).__name__} does not define _take_step()")


def in_fp32(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors``, the fp16/bf16 ones as fp32 copies (an optimizer's math in fp32, rounded
    once when written back with :func:`write_back`)."""
    return [t.float() if t.dtype in LOW_PRECISION else t for t in tensors]


def write_back(tensors: Sequence[torch.Tensor], computed: Sequence[torch.Tensor]) -> None:
    """Copy the results computed in :func:`in_fp32` copies back into the tensors they came
    from."""
    for t, c in zip(tensors, computed, strict=True):
        if c is not t:
            t.copy_(c)
