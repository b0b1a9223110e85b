"""``deepspeed.pipe`` under deepshard's name: a model given as a list of layers, cut into
pipeline stages.

Re-exports only; the classes live in :mod:`deepshard.runtime.parallel.pipe_module`.
DeepSpeed's ``DualPipeVModule`` has no equivalent here.
"""

from ..runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
