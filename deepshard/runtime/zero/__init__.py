"""ZeRO: optimizer state, gradients and parameters sharded over the data-parallel ranks.

DeepSpeed's user-facing names live here: ``deepshard.zero.Init`` (build a model already
partitioned) and ``deepshard.zero.GatheredParameters`` (whole parameters inside a block).
"""

from deepshard.runtime.zero.generation import unwrap_model_for_generation
from deepshard.runtime.zero.init import GatheredParameters, Init
from deepshard.runtime.zero.marks import register_external_parameter, unregister_external_parameter
from deepshard.runtime.zero.status import ZeroParamStatus
from deepshard.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias

__all__ = ["GatheredParameters", "Init", "TiledLinear", "TiledLinearReturnBias",
           "ZeroParamStatus", "register_external_parameter", "unregister_external_parameter",
           "unwrap_model_for_generation"]
