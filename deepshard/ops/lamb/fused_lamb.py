"""``deepspeed.ops.lamb.fused_lamb``: ``FusedLamb`` with DeepSpeed's constructor
(:class:`deepshard.runtime.optim.lamb.FusedLamb`): deepshard's CUDA kernel when every tensor
of a step is on a GPU and CuPy is installed, else
:func:`~deepshard.kernels.lamb.lamb_reference`, the update the runtime's
:class:`~deepshard.runtime.optim.lamb.Lamb` also runs."""

from deepshard.runtime.optim.lamb import FusedLamb

__all__ = ["FusedLamb"]
