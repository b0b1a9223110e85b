"""ZeRO: optimizer state, gradients and parameters sharded over the data-parallel ranks.

DeepSpeed's user-facing names live here: ``deepshard.zero.Init`` (build a model already
partitioned) and ``deepshard.zero.GatheredParameters`` (whole parameters inside a block).
"""

from deepshard.runtime.zero.init import GatheredParameters, Init
from deepshard.runtime.zero.marks import register_external_parameter, unregister_external_parameter
from deepshard.runtime.zero.status import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]
