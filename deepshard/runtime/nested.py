"""The tensors inside nested containers (pure)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``: itself, or inside its dict values, lists and tuples (at
    any depth), in order; anything else holds none."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)
