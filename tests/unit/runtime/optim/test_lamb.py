"""LAMB against a per-tensor reference of DeepSpeed's kernel (``support.ReferenceLamb``)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from deepshard.runtime.optim import Lamb
from tests.unit.runtime.optim.support import (
    LAMB_DEFAULTS,
    ReferenceLamb,
    backward,
    groups_of,
    small_model,
)

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
