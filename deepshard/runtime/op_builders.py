"""DeepSpeed's op builders (``deepspeed.ops.op_builder``), answering for deepshard.

DeepSpeed compiles its C++/CUDA ops on first use (or at install); scripts and Dockerfiles
ask a builder whether its op can work here (``CPUAdamBuilder().is_compatible()``) and
build it ahead of time (``CPUAdamBuilder().load()``). deepshard builds nothing: its
optimizers are torch code (:mod:`deepshard.runtime.optim`) and its CUDA kernels load at run
time (:mod:`deepshard.kernels`). So each builder answers truthfully for deepshard:

- an op deepshard provides (CPU and fused Adam, CPU Adagrad, CPU and fused Lion, fused
  LAMB): ``is_compatible()`` is True and ``load()`` returns the deepshard module that
  implements it (``deepshard.runtime.optim.adam`` for ``CPUAdamBuilder``), whose classes
  are what ``deepspeed.ops.adam.DeepSpeedCPUAdam`` and the like resolve to;
- any other op: ``is_compatible()`` is False and ``load()`` raises a one-line
  :class:`OpNotAvailableError` naming what to use instead.

:data:`COMPATIBLE_OPS` is ``deepspeed.ops.__compatible_ops__``: each op name and whether
its builder is compatible.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType, ModuleType
from typing import ClassVar

from deepshard.errors import UsageError

_ADAM = "deepshard.runtime.optim.adam"
_LION = "deepshard.runtime.optim.lion"
_NVME = ("NVMe offload is the config's zero_optimization.offload_optimizer/offload_param "
         "with device \"nvme\"")
_INFERENCE = "deepshard trains only: run inference on the trained module (engine.module)"
_NONE = "deepshard has no equivalent"


class OpNotAvailableError(UsageError, RuntimeError):
    """``load()`` of an op deepshard does not provide (a ``RuntimeError``, as DeepSpeed's
    failed builds are)."""


class OpBuilder:
    """DeepSpeed's builder interface for one op (see the module docstring)."""

    NAME: ClassVar[str] = "deepspeed_not_implemented"
    """The op's name, DeepSpeed's."""
    MODULE: ClassVar[str | None] = None
    """The deepshard module that implements the op; None: deepshard does not have it."""
    INSTEAD: ClassVar[str] = "this op is not implemented"
    """What to use instead, when deepshard does not have the op."""

    def __init__(self, name: str | None = None):
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        """Where DeepSpeed puts the built op (``deepspeed.ops.<name>_op``)."""
        return f"deepspeed.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether deepshard provides this op (``verbose`` is DeepSpeed's; unused)."""
        return self.MODULE is not None

    def load(self, verbose: bool = True) -> ModuleType:
        """The deepshard module implementing the op (nothing is compiled).

        Raises:
            OpNotAvailableError: deepshard does not provide the op.
        """
        if self.MODULE is None:
            raise OpNotAvailableError(f"deepshard has no {self.NAME} op to build",
                                      where=type(self).__name__, hint=self.INSTEAD)
        return importlib.import_module(self.MODULE)

    def jit_load(self, verbose: bool = True) -> ModuleType:
        """:meth:`load`: deepshard compiles nothing, ahead of time or just in time."""
        return self.load(verbose)

    def sources(self) -> list[str]:
        """No C++/CUDA sources to compile."""
        return []

    def include_paths(self) -> list[str]:
        """No include paths."""
        return []


class CPUAdamBuilder(OpBuilder):
    """DeepSpeed's C++ CPU Adam: ``DeepSpeedCPUAdam`` on torch's fused Adam."""

    NAME, MODULE = "cpu_adam", _ADAM


class FusedAdamBuilder(OpBuilder):
    """DeepSpeed's CUDA multi-tensor Adam: ``FusedAdam`` on torch's fused Adam."""

    NAME, MODULE = "fused_adam", _ADAM


class CPUAdagradBuilder(OpBuilder):
    """DeepSpeed's C++ CPU Adagrad: ``DeepSpeedCPUAdagrad`` in torch ops."""

    NAME, MODULE = "cpu_adagrad", "deepshard.runtime.optim.adagrad"


class CPULionBuilder(OpBuilder):
    """DeepSpeed's C++ CPU Lion: ``DeepSpeedCPULion`` in torch ops."""

    NAME, MODULE = "cpu_lion", _LION


class FusedLionBuilder(OpBuilder):
    """DeepSpeed's CUDA Lion: ``FusedLion`` in torch ops."""

    NAME, MODULE = "fused_lion", _LION


class FusedLambBuilder(OpBuilder):
    """DeepSpeed's CUDA LAMB: ``FusedLamb`` on deepshard's LAMB kernel."""

    NAME, MODULE = "fused_lamb", "deepshard.runtime.optim.lamb"


class NotImplementedBuilder(OpBuilder):
    """DeepSpeed's stand-in for an op the accelerator lacks."""


class AsyncIOBuilder(OpBuilder):
    """DeepSpeed's asynchronous NVMe I/O."""

    NAME, INSTEAD = "async_io", _NVME


class GDSBuilder(OpBuilder):
    """DeepSpeed's GPUDirect Storage I/O."""

    NAME, INSTEAD = "gds", _NVME


class CCLCommBuilder(OpBuilder):
    """DeepSpeed's oneCCL communication backend."""

    NAME, INSTEAD = "deepspeed_ccl_comm", ("deepshard.comm runs on torch.distributed "
                                           "(gloo on CPU, NCCL on CUDA)")


class ShareMemCommBuilder(OpBuilder):
    """DeepSpeed's shared-memory CPU collectives."""

    NAME, INSTEAD = "deepspeed_shm_comm", CCLCommBuilder.INSTEAD


class PinMemoryBuilder(OpBuilder):
    """DeepSpeed's pinned-memory allocator."""

    NAME, INSTEAD = "pin_memory", "use torch's tensor.pin_memory()"


class UtilsBuilder(OpBuilder):
    """DeepSpeed's C++ flatten/unflatten."""

    NAME, INSTEAD = "utils", ("use torch._utils._flatten_dense_tensors and "
                              "_unflatten_dense_tensors")


class TransformerBuilder(OpBuilder):
    """DeepSpeed's fused transformer layer."""

    NAME, INSTEAD = "transformer", ("keep your model's own layers; deepshard's fused "
                                    "kernels are in deepshard.kernels")


class StochasticTransformerBuilder(OpBuilder):
    """DeepSpeed's fused transformer layer, stochastic mode."""

    NAME, INSTEAD = "stochastic_transformer", TransformerBuilder.INSTEAD


class InferenceBuilder(OpBuilder):
    """DeepSpeed-Inference's transformer kernels."""

    NAME, INSTEAD = "transformer_inference", _INFERENCE


class InferenceCoreBuilder(OpBuilder):
    """DeepSpeed-Inference's core ops."""

    NAME, INSTEAD = "inference_core_ops", _INFERENCE


class InferenceCutlassBuilder(OpBuilder):
    """DeepSpeed-Inference's CUTLASS ops."""

    NAME, INSTEAD = "cutlass_ops", _INFERENCE


class RaggedOpsBuilder(OpBuilder):
    """DeepSpeed-FastGen's ragged device ops."""

    NAME, INSTEAD = "ragged_device_ops", _INFERENCE


class RaggedUtilsBuilder(OpBuilder):
    """DeepSpeed-FastGen's ragged utilities."""

    NAME, INSTEAD = "ragged_ops", _INFERENCE


class SpatialInferenceBuilder(OpBuilder):
    """DeepSpeed-Inference's diffusion ops."""

    NAME, INSTEAD = "spatial_inference", _INFERENCE


class QuantizerBuilder(OpBuilder):
    """DeepSpeed's quantization kernels."""

    NAME, INSTEAD = "quantizer", _NONE


class FPQuantizerBuilder(OpBuilder):
    """DeepSpeed's FP8/FP6 quantizer."""

    NAME, INSTEAD = "fp_quantizer", _NONE


class EvoformerAttnBuilder(OpBuilder):
    """DS4Sci's Evoformer attention."""

    NAME, INSTEAD = "evoformer_attn", _NONE


class FlashAttentionBuilder(OpBuilder):
    """DeepSpeed's XPU flash attention."""

    NAME, INSTEAD = "flash_attn", "use torch's scaled_dot_product_attention"


class RandomLTDBuilder(OpBuilder):
    """DeepSpeed's random-LTD token dropping."""

    NAME, INSTEAD = "random_ltd", _NONE


class DeepCompileBuilder(OpBuilder):
    """DeepCompile's runtime."""

    NAME, INSTEAD = "dc", "call engine.compile() (torch.compile on the model)"


BUILDERS: tuple[type[OpBuilder], ...] = (
    NotImplementedBuilder, CPUAdamBuilder, FusedAdamBuilder, CPUAdagradBuilder,
    CPULionBuilder, FusedLionBuilder, FusedLambBuilder, AsyncIOBuilder, GDSBuilder,
    CCLCommBuilder, ShareMemCommBuilder, PinMemoryBuilder, UtilsBuilder, TransformerBuilder,
    StochasticTransformerBuilder, InferenceBuilder, InferenceCoreBuilder,
    InferenceCutlassBuilder, RaggedOpsBuilder, RaggedUtilsBuilder, SpatialInferenceBuilder,
    QuantizerBuilder, FPQuantizerBuilder, EvoformerAttnBuilder, FlashAttentionBuilder,
    RandomLTDBuilder, DeepCompileBuilder)
"""Every builder class."""

COMPATIBLE_OPS = MappingProxyType({b.NAME: b().is_compatible() for b in BUILDERS})
"""``deepspeed.ops.__compatible_ops__``: op name -> whether deepshard provides it."""
