"""Optimizers: LAMB against a per-tensor reference of DeepSpeed's kernel, the Adam/SGD mapping.

The LAMB reference follows ``lamb_cuda_kernel_part1/3`` in DeepSpeed's
``csrc/lamb/fused_lamb_cuda_kernel.cu`` and ``FusedLamb.step``'s clipping, one tensor and one
formula at a time, with no ``_foreach`` ops.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from deepshard.errors import UsageError
from deepshard.runtime.optim import Lamb, build_optimizer

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


def small_model(dtype=torch.float64, seed=0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model[2].bias.data.zero_()  # ||p|| = 0: the trust ratio must fall back to 1
    return model.to(dtype)


def backward(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    x = torch.randn(8, 6, generator=gen, dtype=torch.float64).to(dtype)
    model.zero_grad()
    (model(x).square().sum() * 3).backward()


class ReferenceLamb:
    """DeepSpeed FusedLamb, one tensor and one step at a time, in the parameters' dtype."""

    def __init__(self, groups, **hp):
        self.groups = [{**hp, **g} for g in groups]
        self.state = {}

    @torch.no_grad()
    def step(self):
        for g in self.groups:
            params = [p for p in g["params"] if p.grad is not None]
            divisor = 1.0
            if g["max_grad_norm"] > 0:
                norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
                clip = (norm + 1e-6) / g["max_grad_norm"]
                divisor = clip if clip > 1 else 1.0
            b1, b2 = g["betas"]
            for p in params:
                st = self.state.setdefault(p, {"step": 0, "m": 0.0, "v": 0.0})
                st["step"] += 1
                grad = p.grad / divisor
                st["m"] = b1 * st["m"] + (1 - b1) * grad
                st["v"] = b2 * st["v"] + (1 - b2) * grad * grad
                if g["eps_inside_sqrt"]:
                    denom = torch.sqrt(st["v"] + g["eps"])
                else:
                    denom = torch.sqrt(st["v"]) + g["eps"]
                update = st["m"] / denom + g["weight_decay"] * p
                w, u = float(p.norm()), float(update.norm())
                coeff = 1.0
                if w != 0 and u != 0:
                    coeff = w / u
                    if coeff > g["max_coeff"]:
                        coeff = g["max_coeff"]
                    if coeff < g["min_coeff"]:
                        coeff = g["min_coeff"]
                step_size = g["lr"]
                if g["bias_correction"]:
                    t = st["step"]
                    step_size = g["lr"] * math.sqrt(1 - b2**t) / (1 - b1**t)
                p.sub_(step_size * coeff * update)


LAMB_DEFAULTS = {
    "lr": 1e-3,
    "bias_correction": True,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "eps_inside_sqrt": False,
    "weight_decay": 0.0,
    "max_grad_norm": 0.0,
    "max_coeff": 10.0,
    "min_coeff": 0.01,
}

LAMB_CASES = {
    "defaults": {},
    "decay": {"lr": 0.05, "weight_decay": 0.1},
    "eps_inside_sqrt": {"eps_inside_sqrt": True, "eps": 1e-4},
    "no_bias_correction": {"bias_correction": False, "lr": 0.01},
    "clipping_active": {"max_grad_norm": 0.5, "weight_decay": 0.01},
    "clipping_inactive": {"max_grad_norm": 1e6},
    "coeff_clamped_high": {"max_coeff": 0.075, "min_coeff": 0.0},
    "coeff_clamped_low": {"min_coeff": 0.08, "max_coeff": 60.0},
    "betas": {"betas": (0.8, 0.95), "lr": 0.02},
}


def groups_of(model: torch.nn.Module) -> list[dict]:
    """Two groups with different lrs: weights and biases."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "lr": 0.003}]


@pytest.mark.parametrize("case", list(LAMB_CASES))
def test_lamb_matches_reference_in_float64(case):
    hp = {**LAMB_DEFAULTS, **LAMB_CASES[case]}
    ours_model, ref_model = small_model(), small_model()
    ours = Lamb(groups_of(ours_model), **hp)
    ref = ReferenceLamb(groups_of(ref_model), **hp)
    for step in range(6):
        backward(ours_model, step)
        backward(ref_model, step)
        ours.step()
        ref.step()
        for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    moved = [
        not torch.equal(a, b)
        for a, b in zip(ours_model.parameters(), small_model().parameters(), strict=True)
    ]
    assert all(moved)


def test_lamb_float32_tracks_the_float64_reference():
    hp = {**LAMB_DEFAULTS, "lr": 0.01, "weight_decay": 0.01, "max_grad_norm": 1.0}
    ours_model, ref_model = small_model(torch.float32), small_model(torch.float64)
    ours = Lamb(ours_model.parameters(), **hp)
    ref = ReferenceLamb([{"params": list(ref_model.parameters())}], **hp)
    for step in range(5):
        backward(ours_model, step)
        backward(ref_model, step)
        ours.step()
        ref.step()
    for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_lamb_trust_ratio_is_measured_on_the_uncorrected_update():
    # One step from m = v = 0 with g = 1 everywhere: u = 0.1 / (sqrt(0.001) + eps) per element,
    # ratio = ||p|| / ||u||, step = lr * sqrt(1 - 0.999) / (1 - 0.9) * ratio * u.
    p = torch.nn.Parameter(torch.full((4,), 2.0, dtype=torch.float64))
    p.grad = torch.ones(4, dtype=torch.float64)
    Lamb([p], lr=0.1).step()
    u = 0.1 / (math.sqrt(0.001) + 1e-8)
    ratio = (2.0 * 2) / (u * 2)
    expected = 2.0 - 0.1 * math.sqrt(0.001) / 0.1 * ratio * u
    torch.testing.assert_close(p.detach(), torch.full((4,), expected, dtype=torch.float64))


def test_lamb_leaves_gradients_and_gradless_params_alone():
    model = small_model()
    backward(model, 0)
    model[0].bias.grad = None
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    bias_before = model[0].bias.detach().clone()
    opt = Lamb(model.parameters(), max_grad_norm=0.1)
    opt.step()
    for n, p in model.named_parameters():
        assert (p.grad is None) == (grads[n] is None)
        if p.grad is not None:
            assert torch.equal(p.grad, grads[n])
    assert torch.equal(model[0].bias, bias_before)
    assert model[0].bias not in opt.state
    assert opt.state[model[0].weight]["step"] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lamb_low_precision_params_step_and_stay_finite(dtype):
    model = small_model(torch.float32)
    for p in model.parameters():
        p.data.mul_(300)  # ||p||^2 past fp16's range: norms must be taken in fp32
    model = model.to(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    opt = Lamb(model.parameters(), lr=0.1, max_grad_norm=1.0)
    for step in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(dtype)
        opt.step()
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.isfinite(p).all()
        assert not torch.equal(p, b)
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


def test_lamb_state_dict_round_trip():
    model = small_model()
    opt = Lamb(groups_of(model), lr=0.01, weight_decay=0.01)
    for step in range(3):
        backward(model, step)
        opt.step()
    twin = copy.deepcopy(model)
    twin_opt = Lamb(groups_of(twin), lr=0.5)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for step in range(3, 6):
        for m, o in ((model, opt), (twin, twin_opt)):
            backward(m, step)
            o.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    assert twin_opt.state[twin[0].weight]["step"] == 6


def test_lamb_rejects_bad_settings():
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="amsgrad"):
        Lamb(params, amsgrad=True)
    with pytest.raises(ValueError, match="min_coeff"):
        Lamb(params, min_coeff=2.0, max_coeff=1.0)
    with pytest.raises(ValueError, match="betas"):
        Lamb(params, betas=(1.0, 0.9))


# ---- build_optimizer ----


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
        ("Adagrad", {}, "optimizer.type"),
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
