"""``deepspeed.runtime.pipe.engine``: the pipeline engine ``initialize`` returns for a
``PipelineModule``, defined in :mod:`deepshard.runtime.parallel.pipe_engine`."""

from ..parallel.pipe_engine import PipelineEngine

__all__ = ["PipelineEngine"]
