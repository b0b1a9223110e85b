"""build_optimizer: DeepSpeed's optimizer names and params mapped to torch's and deepshard's."""

from __future__ import annotations

import pytest
import torch

from deepshard.errors import UsageError
from deepshard.runtime.optim import Lamb, build_optimizer
from tests.unit.runtime.optim.support import (
    LAMB_DEFAULTS,
    ReferenceLamb,
    backward,
    groups_of,
    small_model,
)

ADAM_PARAMS = {
    "lr": 1e-2,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.1,
    "bias_correction": True,
    "amsgrad": False,
    "adam_w_mode": True,
    "torch_adam": False,
}


def run_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 4) -> None:
    for step in range(steps):
        backward(model, step)
        opt.step()


@pytest.mark.parametrize(
    ("type_name", "adam_w_mode", "expected_cls"),
    [
        ("Adam", True, torch.optim.AdamW),
        ("Adam", False, torch.optim.Adam),
        ("AdamW", True, torch.optim.AdamW),
        ("AdamW", False, torch.optim.AdamW),  # DeepSpeed forces decoupled decay for AdamW
    ],
)
def test_adam_mapping_matches_torch_reference(type_name, adam_w_mode, expected_cls):
    model, ref_model = small_model(torch.float32), small_model(torch.float32)
    opt = build_optimizer(
        type_name, {**ADAM_PARAMS, "adam_w_mode": adam_w_mode}, model.parameters()
    )
    assert type(opt) is expected_cls
    assert opt.defaults["fused"] is True
    ref = expected_cls(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    run_steps(model, opt)
    run_steps(ref_model, ref)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_adam_w_mode_changes_the_trajectory():
    decoupled, l2 = small_model(torch.float32), small_model(torch.float32)
    run_steps(decoupled, build_optimizer("Adam", ADAM_PARAMS, decoupled.parameters()))
    run_steps(l2, build_optimizer("Adam", {**ADAM_PARAMS, "adam_w_mode": False}, l2.parameters()))
    assert not torch.allclose(decoupled[0].weight, l2[0].weight)


def test_adam_keeps_group_overrides_and_accepts_a_generator_of_groups():
    model = small_model(torch.float32)
    groups = (
        {"params": g["params"], **({"lr": 0.5} if "lr" in g else {})} for g in groups_of(model)
    )
    opt = build_optimizer("AdamW", {"lr": 0.01, "amsgrad": True}, groups)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.5]
    assert all(g["amsgrad"] for g in opt.param_groups)
    assert opt.defaults["weight_decay"] == 0.0  # DeepSpeed's default, not torch AdamW's 0.01
    run_steps(model, opt, 2)


def test_adam_not_fused_where_torch_has_no_fused_kernel():
    param = torch.nn.Parameter(torch.zeros(3, device="meta"))
    opt = build_optimizer("Adam", ADAM_PARAMS, [param])
    assert not opt.defaults["fused"]


def test_adam_bias_correction_false_is_refused_with_its_key():
    with pytest.raises(UsageError) as info:
        build_optimizer(
            "Adam", {**ADAM_PARAMS, "bias_correction": False}, small_model().parameters()
        )
    assert info.value.where == "optimizer.params.bias_correction"
    assert "bias_correction" in str(info.value)


def test_sgd_mapping():
    model = small_model(torch.float32)
    params = {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 1e-4, "nesterov": True}
    opt = build_optimizer("SGD", params, model.parameters())
    assert type(opt) is torch.optim.SGD
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"], group["nesterov"]) == (
        0.1,
        0.9,
        1e-4,
        True,
    )


def test_lamb_mapping():
    model = small_model()
    params = {**LAMB_DEFAULTS, "lr": 0.02, "max_grad_norm": 1.0, "betas": [0.8, 0.9]}
    opt = build_optimizer("LAMB", params, model.parameters())
    assert type(opt) is Lamb
    assert opt.defaults["betas"] == (0.8, 0.9)
    assert opt.defaults["max_grad_norm"] == 1.0
    ref_model = small_model()
    ref = ReferenceLamb(
        [{"params": list(ref_model.parameters())}], **{**params, "betas": (0.8, 0.9)}
    )
    for step in range(3):
        backward(model, step)
        backward(ref_model, step)
        opt.step()
        ref.step()
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("type_name", "params", "where"),
    [
        ("RMSprop", {}, "optimizer.type"),
        ("Adam", {"lr": 0.1, "max_grad_norm": 1.0}, "optimizer.params.max_grad_norm"),
        ("LAMB", {"amsgrad": True}, "optimizer.params.amsgrad"),
        ("SGD", {"lr": 0.1, "nesterov": True}, "optimizer.params"),  # nesterov needs momentum
        ("Adam", {"lr": -1.0}, "optimizer.params"),
        ("LAMB", {"min_coeff": 5.0, "max_coeff": 1.0}, "optimizer.params"),
    ],
)
def test_build_errors_name_the_key(type_name, params, where):
    with pytest.raises(UsageError) as info:
        build_optimizer(type_name, params, small_model().parameters())
    assert info.value.where == where


def test_build_refuses_no_parameters():
    with pytest.raises(ValueError, match="no parameters"):
        build_optimizer("SGD", {"lr": 0.1}, [])
