"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam``, both torch's fused Adam
kernels under DeepSpeed's constructors (:mod:`deepshard.runtime.optim.adam`). DeepSpeed's
``ZenFlow*`` Adams have no equivalent here."""

from deepshard.runtime.optim.adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
