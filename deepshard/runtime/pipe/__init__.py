"""``deepspeed.runtime.pipe`` under deepshard's name, with the module paths DeepSpeed scripts
import (``.engine``, ``.module``, ``.topology``): re-exports of :mod:`deepshard.runtime.parallel`.

DeepSpeed's package also exports ``ProcessTopology`` (a grid over any named axes); deepshard's
grid is the fixed ``(pipe, data, tensor)`` :class:`~deepshard.runtime.parallel.topology.
Topology`, built by the named constructors in :mod:`.topology`.
"""

from .module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
