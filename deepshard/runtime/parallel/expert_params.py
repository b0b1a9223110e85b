"""``deepspeed.moe.utils``: which parameters are experts' and the optimizer param groups
that keep them apart.

An expert parameter is marked as DeepSpeed marks it: ``param.allreduce = False`` (its
gradient is not averaged over the whole data-parallel group) and ``param.group_name``, the
expert-data-parallel group it belongs to. A model without MoE layers has none, and the
helpers return its groups unchanged.
"""

from __future__ import annotations

from typing import Any

import torch


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert's (``allreduce`` set to False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(
        params: list[torch.nn.Parameter]) -> tuple[list, list]:
    """``(shared, expert)`` parameters, each in the order given."""
    shared = [p for p in params if not is_moe_param(p)]
    return shared, [p for p in params if is_moe_param(p)]


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict | tuple | list, max_group_size: int | float | None = 178956971
) -> list[dict[str, Any]]:
    """DeepSpeed's: every param group keeps its shared parameters, and its expert ones move
    to a group of their own per ``group_name`` (same hyperparameters, ``name`` set to the
    expert group's, ``"moe": True``), after the shared groups.

    ``max_group_size`` is accepted for DeepSpeed's signature; deepshard does not cut the
    expert groups by it (its ZeRO flat groups are capped by ``reduce_bucket_size``).
    """
    del max_group_size
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    experts: list[dict[str, Any]] = []
    for index, group in enumerate(param_groups):
        by_name: dict[str, dict[str, Any]] = {}
        for p in group["params"]:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, {**group, "name": p.group_name,
                                                  "moe": True, "params": []})
                by_name[p.group_name]["params"].append(p)
        group["params"] = [p for p in group["params"] if not is_moe_param(p)]
        group.setdefault("name", f"group_{index}")
        experts.extend(by_name.values())
    return [*param_groups, *experts]


def is_moe_param_group(param_group: dict) -> bool:
    """Whether an optimizer param group holds expert parameters."""
    return param_group.get("moe", False)
