"""DeepSpeed's ``engine.config``: the config as the user gave it, a ``dict``.

transformers' ``Trainer.save_model`` reads ``engine.config.get("zero_optimization", {})``;
deepshard's own code reads the validated tree (``engine.config.zero_optimization.stage``).
:class:`GivenConfig` is both: a ``dict`` of the config as given (a file's contents for a
path), whose attributes are the validated :class:`~deepshard.config.DeepShardConfig`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class GivenConfig(dict):
    """The given config as a ``dict``; attribute access reads the validated config."""

    def __init__(self, given: Mapping[str, Any], validated: Any):
        super().__init__(given)
        object.__setattr__(self, "_validated", validated)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_validated"), name)

    def __reduce__(self) -> tuple[Any, ...]:
        return GivenConfig, (dict(self), object.__getattribute__(self, "_validated"))
