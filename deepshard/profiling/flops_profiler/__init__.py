"""``deepspeed.profiling.flops_profiler``: ``get_model_profile`` and DeepSpeed's
``FlopsProfiler`` API (:mod:`.profiler`), over :mod:`deepshard.runtime.flops_profiler`."""

from .profiler import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = ["FlopsProfiler", "duration_to_string", "flops_to_string", "get_model_profile",
           "macs_to_string", "number_to_string", "params_to_string"]
