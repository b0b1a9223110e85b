"""DeepSpeed's compressed-communication optimizers, on any process group and on CPU:
1-bit Adam (:class:`OneBitAdam`), 0/1 Adam (:class:`ZeroOneAdam`) and 1-bit LAMB
(:class:`OneBitLamb`), over the compressed all-reduce with error feedback of
:mod:`.compressed`.

They do their own communication in ``step()``: the engine asks
``communicates_next_step()`` before each step and, when true, skips its dense gradient
all-reduce (:mod:`deepshard.runtime.strategy.compressed`; ZeRO stage 1 for 1-bit Adam:
:mod:`deepshard.runtime.zero.onebit`). Each rank's compression errors live outside
``state`` (``error_state`` / ``load_error_state``) and go into its own checkpoint file.
"""

from deepshard.runtime.optim.onebit.adam import OneBitAdam, OnebitAdam
from deepshard.runtime.optim.onebit.compressed import CompressedAllreduce
from deepshard.runtime.optim.onebit.lamb import OneBitLamb, OnebitLamb
from deepshard.runtime.optim.onebit.zoadam import ZeroOneAdam

__all__ = ["CompressedAllreduce", "OneBitAdam", "OneBitLamb", "OnebitAdam", "OnebitLamb",
           "ZeroOneAdam"]
