"""DeepSpeed's ``unwrap_model_for_generation``: a ZeRO-3 model whole for a block of
generation (RLHF trainers generate with the policy between training steps).

At ZeRO-3 the block gathers every parameter of the model on entry and partitions them
again on exit, as :class:`~deepshard.runtime.zero.init.GatheredParameters` does (a
collective: every rank enters the block). At stages 0-2, or for a model that was never
partitioned, nothing is gathered and the model is yielded as it is.

As with DeepSpeed (which takes its per-module ZeRO-3 hooks off for the block),
generation runs on the parameters gathered once: a gathered group stays gathered while a
``GatheredParameters`` block holds it, so the forwards inside release nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from deepshard.runtime.zero.init import GatheredParameters

__all__ = ["unwrap_model_for_generation"]


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Yield ``model`` (an engine or an ``nn.Module``) with its ZeRO-3 parameters gathered
    for the block (see the module docstring); other models are yielded untouched."""
    with GatheredParameters(list(model.parameters())):
        yield model
