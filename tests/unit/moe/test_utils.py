"""``deepshard.runtime.parallel.expert_params`` (``deepspeed.moe.utils``): expert parameters
kept apart."""

from __future__ import annotations

import pytest
import torch

from deepshard.runtime.parallel.expert_params import (
    is_moe_param,
    is_moe_param_group,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)


def params():
    shared = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    experts = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    for p, group in zip(experts, ["ep_a", "ep_b", "ep_a"], strict=True):
        p.allreduce, p.group_name = False, group
    return shared, experts


def test_a_model_without_experts_keeps_its_groups():
    shared, _ = params()
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": shared, "lr": 0.1})
    assert len(groups) == 1 and groups[0]["params"] == shared and groups[0]["lr"] == 0.1
    assert not is_moe_param_group(groups[0])


def test_expert_parameters_move_to_one_group_per_expert_group():
    shared, experts = params()
    assert [is_moe_param(p) for p in shared + experts] == [False] * 2 + [True] * 3
    assert split_params_into_shared_and_expert_params(shared + experts) == (shared, experts)
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [shared[0], experts[0], experts[1]], "lr": 0.1},
         {"params": [shared[1], experts[2]], "lr": 0.2, "name": "second"}])
    assert [g["name"] for g in groups] == ["group_0", "second", "ep_a", "ep_b", "ep_a"]
    assert [g["params"] for g in groups] == [[shared[0]], [shared[1]], [experts[0]],
                                             [experts[1]], [experts[2]]]
    assert [g["lr"] for g in groups] == [0.1, 0.2, 0.1, 0.1, 0.2]
    assert [is_moe_param_group(g) for g in groups] == [False, False, True, True, True]
    with pytest.raises(ValueError, match="Unknown param group type"):
        split_params_into_different_moe_groups_for_optimizer("nope")
