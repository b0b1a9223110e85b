"""Dynamic batching's settings, read from a ``data_efficiency`` config section.

Accepts the section as written in a ds_config or as DeepSpeed normalises it (defaults filled
in); every mistake is a :class:`UsageError` whose ``where`` is the key's path. Defaults are
DeepSpeed 0.19.8's.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepshard.data_efficiency.dynamic_batching_plan import (
    LR_SCALING_METHODS,
    PICKING_ORDERS,
    lr_scaling_method_name,
)
from deepshard.errors import UsageError

KEY = "data_efficiency.data_sampling.dynamic_batching"
"""The config path of the section."""
_SAMPLING = "data_efficiency.data_sampling"
_RENAMED = {"max_tokens_per_batch": "max_tokens", "samples_order": "sequence_picking_order",
            "seqlen_sample_to_metric_path": "metrics_path"}


@dataclass(frozen=True)
class DynamicBatchingSettings:
    """``data_efficiency.data_sampling.dynamic_batching`` and what it uses around it."""

    max_tokens: int
    """Token budget of one micro-batch (the sum of its samples' lengths)."""
    lr_scaling_method: str = "linear"
    """How the learning rate follows a batch's size: ``linear``, ``sqrt`` or ``none``."""
    min_batch_size: int = 1
    """Fewest sequences in a micro-batch."""
    max_batch_size: int | None = None
    """Most sequences in a micro-batch; ``None``: no limit."""
    sequence_picking_order: str = "dataloader"
    """Order samples are packed in: ``dataloader``, ``seqlen`` (ascending) or ``random``."""
    metrics_path: str | None = None
    """Folder of the data analyzer's output, holding ``seqlen/seqlen_sample_to_metric``."""
    verbose: bool = False
    """Log every batch's arithmetic and every step's learning rate."""
    seed: int = 1234
    """``data_efficiency.seed``: the ``random`` picking order's."""
    num_workers: int = 0
    """``data_efficiency.data_sampling.num_workers``: loader worker processes."""
    pin_memory: bool = False
    """``data_efficiency.data_sampling.pin_memory``: the loader's."""


def dynamic_batching_settings(data_efficiency: Mapping[str, Any]) -> DynamicBatchingSettings:
    """The settings of ``data_efficiency`` (the config's ``data_efficiency`` section), which
    must enable dynamic batching and set ``max_tokens``."""
    sampling = _section(data_efficiency, "data_sampling", "data_efficiency")
    section = _section(sampling, "dynamic_batching", _SAMPLING)
    if not _flag(section, "enabled", False, KEY):
        raise UsageError("dynamic batching is not enabled", where=f"{KEY}.enabled",
                         hint=f'set "enabled": true in {KEY}')
    if "max_tokens" not in section:
        old = [k for k, new in _RENAMED.items() if k in section and new == "max_tokens"]
        raise UsageError("dynamic batching needs a token budget", where=f"{KEY}.max_tokens",
                         hint=f'rename "{old[0]}" to "max_tokens"' if old else
                         'set "max_tokens": the most tokens in one micro-batch')
    min_size = _integer(section, "min_batch_size", 1, KEY, low=0)
    max_size = _optional_integer(section, "max_batch_size", None, KEY, low=max(1, min_size))
    return DynamicBatchingSettings(
        max_tokens=_integer(section, "max_tokens", 0, KEY, low=1),
        lr_scaling_method=_choice(section, "lr_scaling_method", "linear", LR_SCALING_METHODS),
        min_batch_size=min_size, max_batch_size=max_size,
        sequence_picking_order=_choice(section, "sequence_picking_order", "dataloader",
                                       PICKING_ORDERS),
        metrics_path=_path(section, "metrics_path"),
        verbose=_flag(section, "verbose", False, KEY),
        seed=_integer(data_efficiency, "seed", 1234, "data_efficiency"),
        num_workers=_integer(sampling, "num_workers", 0, _SAMPLING, low=0),
        pin_memory=_flag(sampling, "pin_memory", False, _SAMPLING))


def _section(parent: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = parent.get(key, {})
    if not isinstance(value, Mapping):
        raise UsageError(f"must be a section, not {type(value).__name__}", where=f"{where}.{key}")
    return value


def _integer(section: Mapping[str, Any], key: str, default: int, where: str, *,
             low: int | None = None) -> int:
    value = _optional_integer(section, key, default, where, low=low)
    assert value is not None  # the default is an integer
    return value


def _optional_integer(section: Mapping[str, Any], key: str, default: int | None, where: str, *,
                      low: int | None = None) -> int | None:
    value = section.get(key, default)
    if value is None:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or (
            low is not None and value < low):
        bound = "an integer" if low is None else f"an integer of at least {low}"
        raise UsageError(f"must be {bound}, not {value!r}", where=f"{where}.{key}")
    return int(value)


def _flag(section: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise UsageError(f"must be true or false, not {value!r}", where=f"{where}.{key}")
    return value


def _choice(section: Mapping[str, Any], key: str, default: str, choices: tuple[str, ...]) -> str:
    value = section.get(key, default)
    if key == "lr_scaling_method":
        return lr_scaling_method_name(value, where=f"{KEY}.{key}")
    if value not in choices:
        raise UsageError(f"unknown value {value!r}", where=f"{KEY}.{key}",
                         hint=f"use one of {', '.join(choices)}")
    return str(value)


def _path(section: Mapping[str, Any], key: str) -> str | None:
    value = section.get(key)
    if value is not None and not isinstance(value, str):
        raise UsageError(f"must be a path, not {value!r}", where=f"{KEY}.{key}")
    return value
