"""DeepSpeed's ``deepspeed.runtime.fp16`` path, for the 1-bit optimizers' module names
(:mod:`.onebit`). The fp16 optimizer wrappers DeepSpeed keeps here are the config's
``fp16`` section in deepshard."""
