"""deepshard: a DeepSpeed-compatible launcher and training runtime.

This module runs for every ``import deepshard.launcher``, including inside ``ds-run`` on a
login node, so it must not import torch. The runtime API is offered lazily: the first access
to ``deepshard.init_distributed`` imports :mod:`deepshard.runtime`, and with it torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from deepshard.contract import DEEPSHARD_VERSION as __version__

if TYPE_CHECKING:  # the lazy names deepshard itself calls, as type checkers see them
    from deepshard.runtime.api import initialize as initialize


# public name -> module that defines it; resolved on first attribute access (PEP 562)
_LAZY = {
    "heartbeat": "deepshard.liveness",
    "report": "deepshard.liveness",
    "init_distributed": "deepshard.comm.distributed",
    "DistEnv": "deepshard.comm.distributed",
    "initialize": "deepshard.runtime.api",
    "add_config_arguments": "deepshard.runtime.api",
    "tp_model_init": "deepshard.runtime.parallel.tp_init",
    "DeepShardEngine": "deepshard.runtime.engine",
    "PipelineEngine": "deepshard.runtime.parallel.pipe_engine",
    "PipelineModule": "deepshard.runtime.parallel.pipe_module",
    "LayerSpec": "deepshard.runtime.parallel.pipe_module",
    "TiedLayerSpec": "deepshard.runtime.parallel.pipe_module",
    "get_accelerator": "deepshard.accelerator",
    "log_dist": "deepshard.runtime.logs",
    "logger": "deepshard.runtime.logs",
    "get_fp32_state_dict": "deepshard.runtime.checkpoint.consolidate",
    "OnDevice": "deepshard.runtime.on_device",
    "init_inference": "deepshard.inference.api",
    "InferenceEngine": "deepshard.inference.engine",
    "UsageError": "deepshard.errors",
}
# DeepSpeed's spellings of the same things
_ALIASES = {"get_fp32_state_dict_from_zero_checkpoint": "get_fp32_state_dict",
            "DeepSpeedEngine": "DeepShardEngine",
            # deepshard's config errors are UsageErrors: DeepSpeed users catch them so
            "DeepSpeedConfigError": "UsageError"}
# submodules offered as attributes, like ``deepspeed.checkpointing`` and ``deepspeed.comm``;
# DeepSpeed's other paths (``deepspeed.pipe``, ``deepspeed.utils``) are deepshard.compat.paths rows
_MODULES = {"checkpointing": "deepshard.runtime.activation_checkpointing",
            "zero": "deepshard.runtime.zero",
            "comm": "deepshard.comm",
            "accelerator": "deepshard.accelerator",
            "runtime": "deepshard.runtime"}

__all__ = ["__version__", *_LAZY, *_ALIASES, *_MODULES]


def __getattr__(name: str) -> object:
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    name = _ALIASES.get(name, name)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deepshard' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
