"""``deepspeed.runtime.pipe.module``: the pipeline module and its layer blueprints, defined
in :mod:`deepshard.runtime.parallel.pipe_module`."""

from ..parallel.pipe_module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
