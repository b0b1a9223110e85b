"""DeepSpeed's ``ZeroStageEnum``: the ZeRO stages by what each one partitions.

The config's ``zero_optimization.stage`` is the plain int; this enum is an ``int`` too, so
``config.zero_optimization.stage == ZeroStageEnum.weights`` holds at stage 3.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ZeroStageEnum"]


class ZeroStageEnum(IntEnum):
    """The ZeRO stages (``deepspeed.runtime.zero.config.ZeroStageEnum``)."""

    disabled = 0
    """Stage 0: nothing partitioned (plain data parallelism)."""
    optimizer_states = 1
    """Stage 1: optimizer state partitioned."""
    gradients = 2
    """Stage 2: gradients too."""
    weights = 3
    """Stage 3: parameters too."""
    max_stage = 3
    """The highest stage (an alias of ``weights``)."""
