"""``deepspeed.runtime.fp16.onebit.zoadam``: deepshard's 0/1 Adam."""

from deepshard.runtime.optim.onebit.zoadam import ZeroOneAdam

__all__ = ["ZeroOneAdam"]
