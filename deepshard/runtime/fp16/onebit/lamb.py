"""``deepspeed.runtime.fp16.onebit.lamb``: :class:`OnebitLamb` is deepshard's 1-bit LAMB."""

from deepshard.runtime.optim.onebit.lamb import OneBitLamb, OnebitLamb

__all__ = ["OneBitLamb", "OnebitLamb"]
