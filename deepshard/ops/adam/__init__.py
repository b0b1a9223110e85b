"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam``, both torch's fused Adam
kernels under DeepSpeed's constructors (:mod:`.torch_adam`). DeepSpeed's ``ZenFlow*`` Adams
have no equivalent here."""

from .cpu_adam import DeepSpeedCPUAdam
from .fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
