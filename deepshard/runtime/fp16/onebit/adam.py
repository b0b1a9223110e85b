"""``deepspeed.runtime.fp16.onebit.adam``: :class:`OnebitAdam` is deepshard's 1-bit Adam."""

from deepshard.runtime.optim.onebit.adam import OneBitAdam, OnebitAdam

__all__ = ["OneBitAdam", "OnebitAdam"]
