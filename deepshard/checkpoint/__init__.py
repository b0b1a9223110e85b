"""``deepspeed.checkpoint``: the helpers scripts and integrations import from it. deepshard's
checkpoint format itself is :mod:`deepshard.runtime.checkpoint`."""
