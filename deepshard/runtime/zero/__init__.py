"""ZeRO: optimizer state, gradients and parameters sharded over the data-parallel ranks.

DeepSpeed's user-facing names live here: ``deepshard.zero.Init`` (build a model already
partitioned) and ``deepshard.zero.GatheredParameters`` (whole parameters inside a block).
"""

from deepshard.runtime.zero.init import Init
from deepshard.runtime.zero.stage3 import GatheredParameters

__all__ = ["GatheredParameters", "Init"]
