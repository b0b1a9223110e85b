"""DeepSpeed's module path of the 1-bit optimizers (``deepspeed.runtime.fp16.onebit.adam
.OnebitAdam``, ``.zoadam.ZeroOneAdam``, ``.lamb.OnebitLamb``): deepshard's
:mod:`deepshard.runtime.optim.onebit` under DeepSpeed's names."""
