"""``deepspeed.profiling`` under deepshard's name: the flops profiler (:mod:`.flops_profiler`)."""
