"""``deepspeed.runtime.pipe.topology``: DeepSpeed's named topology constructors, defined in
:mod:`deepshard.runtime.parallel.topology`. They return deepshard's ``(pipe, data, tensor)``
:class:`~deepshard.runtime.parallel.topology.Topology` (DeepSpeed's ``model`` axis is its
``tensor`` axis, laid out the same way: rank = (pipe * data_size + data) * model_size + model),
which ``PipelineModule(topology=...)`` accepts."""

from ..parallel.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology"]
