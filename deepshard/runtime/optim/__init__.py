"""The optimizers: what a DeepSpeed config's ``optimizer`` section builds
(:func:`build_optimizer`), DeepSpeed's ``FusedAdam``, ``DeepSpeedCPUAdam`` and ``FusedLamb``
(:mod:`.adam`, :mod:`.lamb`; ``deepshard.compat.paths`` maps DeepSpeed's ``deepspeed.ops``
paths to them), deepshard's kernel optimizers and the 1-bit ones (:mod:`.onebit`). Every one of them
steps through :class:`~.base.StepOptimizer`."""

from deepshard.runtime.optim.adam import DeepSpeedCPUAdam, FusedAdam, KernelAdam, TorchAdam
from deepshard.runtime.optim.base import StepOptimizer
from deepshard.runtime.optim.build import build_optimizer
from deepshard.runtime.optim.lamb import FusedLamb, KernelLamb, Lamb

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "FusedLamb", "KernelAdam", "KernelLamb", "Lamb",
           "StepOptimizer", "TorchAdam", "build_optimizer"]
