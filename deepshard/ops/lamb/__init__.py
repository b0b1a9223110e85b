"""``deepspeed.ops.lamb``: ``FusedLamb`` (:class:`deepshard.runtime.optim.lamb.FusedLamb`)."""

from deepshard.runtime.optim.lamb import FusedLamb

__all__ = ["FusedLamb"]
