"""deepshard: a DeepSpeed-compatible launcher and training runtime.

This module runs for every ``import deepshard.launcher``, including inside ``ds-run`` on a
login node, so it must not import torch. The runtime API is offered lazily: the first access
to ``deepshard.init_distributed`` imports :mod:`deepshard.runtime`, and with it torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it; resolved on first attribute access (PEP 562)
_LAZY = {
    "heartbeat": "deepshard.liveness",
    "init_distributed": "deepshard.runtime.distributed",
    "DistEnv": "deepshard.runtime.distributed",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deepshard' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
