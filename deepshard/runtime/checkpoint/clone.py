"""``deepspeed.checkpoint.utils``: :func:`clone_tensors_for_torch_save` (Accelerate's
``get_state_dict`` calls it at ZeRO stages 0-2)."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """A copy of ``item`` with every tensor in it (nested in lists, tuples and dicts)
    replaced by a detached clone on ``device``, so that ``torch.save`` writes only the
    values, not the storages they are views of (DeepSpeed's semantics)."""
    device = torch.device(device)
    if torch.is_tensor(item):
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
