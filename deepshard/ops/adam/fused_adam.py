"""``deepspeed.ops.adam.fused_adam``: ``FusedAdam`` with DeepSpeed's constructor, on torch's
fused Adam kernels (:class:`deepshard.runtime.optim.adam.FusedAdam`)."""

from deepshard.runtime.optim.adam import FusedAdam

__all__ = ["FusedAdam"]
