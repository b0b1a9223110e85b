"""The build steps of ``deepshard.initialize``, one module each: the model
(:mod:`.model`: placement, dtype, rank 0's weights, model-parallel preparation), the
data-parallel strategy (:mod:`.strategy`) and the optimizer over what the strategy steps
(:mod:`.optimizer`)."""
