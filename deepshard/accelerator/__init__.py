"""``deepspeed.accelerator`` for deepshard: ``get_accelerator()`` and the CPU and CUDA
accelerators, with DeepSpeed's method names (``from deepshard.accelerator import
get_accelerator`` in place of ``from deepspeed.accelerator import get_accelerator``)."""

from deepshard.accelerator.abstract_accelerator import Accelerator, DeepSpeedAccelerator
from deepshard.accelerator.cpu_accelerator import CPU_Accelerator, CPUAccelerator
from deepshard.accelerator.cuda_accelerator import CUDA_Accelerator, CUDAAccelerator
from deepshard.accelerator.real_accelerator import (
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = [
    "Accelerator",
    "CPUAccelerator",
    "CPU_Accelerator",
    "CUDAAccelerator",
    "CUDA_Accelerator",
    "DeepSpeedAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]
