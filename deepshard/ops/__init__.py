"""``deepspeed.ops`` under deepshard's name: the optimizers DeepSpeed scripts build themselves
(``ops.adam.FusedAdam``, ``ops.adam.DeepSpeedCPUAdam``, ``ops.lamb.FusedLamb``), with DeepSpeed's
constructor arguments and no build step. Only re-exports: the classes are in
:mod:`deepshard.runtime.optim` (Adam on torch's fused kernels, LAMB on
:mod:`deepshard.kernels.lamb`)."""
