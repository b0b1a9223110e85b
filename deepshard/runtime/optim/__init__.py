"""The optimizers: what a DeepSpeed config's ``optimizer`` section builds
(:func:`build_optimizer`), DeepSpeed's ``FusedAdam``, ``DeepSpeedCPUAdam``, ``FusedLamb``,
``DeepSpeedCPUAdagrad``, ``DeepSpeedCPULion`` and ``FusedLion`` (:mod:`.adam`, :mod:`.lamb`,
:mod:`.adagrad`, :mod:`.lion`; ``deepshard.compat.paths`` maps DeepSpeed's ``deepspeed.ops``
paths to them), deepshard's kernel optimizers and the 1-bit ones (:mod:`.onebit`). Every one of them
steps through :class:`~.base.StepOptimizer`."""

from deepshard.runtime.optim.adagrad import DeepSpeedCPUAdagrad
from deepshard.runtime.optim.adam import DeepSpeedCPUAdam, FusedAdam, KernelAdam, TorchAdam
from deepshard.runtime.optim.base import StepOptimizer
from deepshard.runtime.optim.build import build_optimizer
from deepshard.runtime.optim.lamb import FusedLamb, KernelLamb, Lamb
from deepshard.runtime.optim.lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPUAdagrad", "DeepSpeedCPUAdam", "DeepSpeedCPULion", "FusedAdam",
           "FusedLamb", "FusedLion", "KernelAdam", "KernelLamb", "Lamb", "StepOptimizer",
           "TorchAdam", "build_optimizer"]
