"""DeepSpeed's ``deepspeed.tp_model_init``: tensor-parallel arguments checked before
``initialize``.

In DeepSpeed 0.19.8 ``tp_model_init`` shards nothing: it records ``tp_size`` and ``dtype``
for ``initialize``, which applies AutoTP from the config's ``tensor_parallel`` section, the
config winning and a mismatch being an error. transformers calls it whenever that section
has ``autotp_size > 1``. deepshard's ``initialize`` applies AutoTP from the same section, so
this checks the arguments against the config and returns the model unchanged; without a
config (DeepSpeed's ``tp_group``/``mpu``-only forms) it refuses with the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from deepshard.config.dialect import read_config_source
from deepshard.errors import UsageError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def tp_model_init(model: torch.nn.Module, tp_size: int, dtype: torch.dtype,
                  config: Any = None, **kwargs: Any) -> torch.nn.Module:
    """Check ``tp_size`` and ``dtype`` against ``config``'s ``tensor_parallel.autotp_size``
    and precision sections; returns ``model`` (``initialize`` shards it).

    Raises:
        UsageError: no config, or the config says another size or dtype.
    """
    if kwargs.get("tp_group") is not None:
        raise UsageError("tp_model_init(tp_group=...) is not supported",
                         where="deepspeed.tp_model_init",
                         hint="set tensor_parallel.autotp_size in the config; initialize "
                              "builds the tensor-parallel groups")
    if config is None:
        raise UsageError("tp_model_init without a config: deepshard applies AutoTP from the "
                         "config at initialize", where="deepspeed.tp_model_init",
                         hint=f"pass config= with tensor_parallel.autotp_size {tp_size} (the "
                              "config you give initialize)")
    data, origin = read_config_source(getattr(config, "config", config))
    size = (data.get("tensor_parallel") or {}).get("autotp_size", 1)
    if size != tp_size:
        raise UsageError(f"tp_model_init(tp_size={tp_size}) but the config says {size}",
                         where=f"{origin}: tensor_parallel.autotp_size",
                         hint="give both the same size (the config's is the one used)")
    configured = next((t for key, t in _DTYPES.items()
                       if (data.get(key) or {}).get("enabled") is True), torch.float32)
    if dtype is not None and dtype != configured:
        raise UsageError(f"tp_model_init(dtype={dtype}) but the config trains in {configured}",
                         where=f"{origin}: bf16/fp16",
                         hint="give tp_model_init the dtype the config enables")
    return model
