"""``deepspeed.ops.adam.cpu_adam``: ``DeepSpeedCPUAdam`` with DeepSpeed's constructor, on
torch's fused Adam kernel (:class:`deepshard.runtime.optim.adam.DeepSpeedCPUAdam`)."""

from deepshard.runtime.optim.adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
