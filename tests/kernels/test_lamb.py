"""Fused LAMB: the runtime's Lamb is the reference (one oracle), KernelLamb against it, nvcc
compiles the kernels, and (on a GPU with CuPy) the kernels against the reference."""

from __future__ import annotations

import pytest
import torch

from deepshard.kernels.lamb import (
    clip_divisor,
    device_clip_divisor,
    fused_lamb_step,
    lamb_reference,
)
from deepshard.runtime.optim.lamb import KernelLamb, Lamb
from tests.kernels.support import needs_gpu, ptx_entries

SIZES = (1, 7, 300, 4097)
CASES = {
    "default": dict(lr=1e-2, weight_decay=0.01),
    "no_bias_correction": dict(lr=1e-2, bias_correction=False),
    "eps_inside_sqrt": dict(lr=1e-2, eps=1e-4, eps_inside_sqrt=True, weight_decay=0.1),
    # Ratios clamp at both ends: large params vs a tight max, and a floor above 1.
    "clamped_max": dict(lr=1e-2, max_coeff=0.5, min_coeff=0.1),
    "clamped_min": dict(lr=1e-3, max_coeff=20.0, min_coeff=5.0),
    "clipped": dict(lr=1e-2, max_grad_norm=0.5, betas=(0.8, 0.9)),
}


def _tensors(sizes, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(s, generator=gen) for s in sizes]


def _run_pair(hp, dtype=torch.float32, steps=4):
    start = [p.to(dtype) for p in _tensors(SIZES, 1, scale=3.0)]
    start.append(torch.zeros(5, dtype=dtype))  # ||p|| = 0 at step 1: ratio 1
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    opts = KernelLamb(ours, **hp), Lamb(theirs, **hp)
    for step in range(steps):
        grads = _tensors([p.numel() for p in start], 100 + step)
        for params, opt in zip((ours, theirs), opts, strict=True):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.to(dtype)
            opt.step()
    return start, ours, theirs, opts[0]


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_lamb_on_cpu_matches_runtime_lamb(case):
    start, ours, theirs, opt = _run_pair(CASES[case])
    for a, b, s in zip(ours, theirs, start, strict=True):
        assert not torch.equal(a, s)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    state = opt.state[ours[0]]
    assert state["step"] == 4 and state["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_params_match_runtime_lamb(dtype):
    start, ours, theirs, opt = _run_pair(CASES["default"], dtype=dtype)
    eps = torch.finfo(dtype).eps
    # bf16 steps below half an ulp leave a 1-element tensor unchanged (in both optimizers).
    assert not torch.equal(ours[3], start[3])
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == dtype
        # Both compute in fp32 from the same state; at most one rounding apart per step.
        torch.testing.assert_close(a.float(), b.float(), rtol=4 * eps, atol=4 * eps)
    assert opt.state[ours[0]]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_runtime_lamb_steps_exactly_as_the_reference(dtype):
    hp = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)
    start = [p.to(dtype) for p in _tensors(SIZES, 1, scale=3.0)]
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = Lamb(params, **hp)
    ref = [p.clone() for p in start]
    moment = torch.float32 if dtype == torch.bfloat16 else dtype
    ms, vs = ([torch.zeros_like(p, dtype=moment) for p in ref] for _ in range(2))
    for step in range(1, 4):
        grads = [g.to(dtype) for g in _tensors(SIZES, 100 + step)]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        lamb_reference(ref, grads, ms, vs, step=step, lr=1e-2, beta1=0.9, beta2=0.999,
                       eps=1e-8, weight_decay=0.01, grad_divisor=clip_divisor(grads, 0.5))
    for a, b in zip(params, ref, strict=True):
        assert torch.equal(a.detach(), b)


def test_device_clip_divisor_is_the_reference_divisor():
    grads = _tensors(SIZES, 3)
    assert clip_divisor(grads, 0.0) == float(device_clip_divisor(grads, 0.0)) == 1.0
    assert clip_divisor(grads, 1e9) == float(device_clip_divisor(grads, 1e9)) == 1.0
    ours = float(device_clip_divisor(grads, 0.5))
    assert ours > 1 and ours == pytest.approx(clip_divisor(grads, 0.5), rel=1e-6)


def test_reference_trust_ratio_by_hand():
    # One element: m = 0.1 g, v = 0.001 g^2, u = m / sqrt(v) = sign(g) * 0.1/sqrt(0.001).
    p, g = torch.tensor([2.0]), torch.tensor([-4.0])
    m, v = torch.zeros(1), torch.zeros(1)
    lamb_reference([p], [g], [m], [v], step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=0.0,
                   weight_decay=0.0, bias_correction=False, max_coeff=10.0, min_coeff=0.01)
    u = -0.1 / 0.001**0.5
    ratio = 2.0 / abs(u)
    torch.testing.assert_close(p, torch.tensor([2.0 - 0.1 * ratio * u]))
    torch.testing.assert_close(m, torch.tensor([-0.4]))


def test_build_optimizer_picks_kernel_lamb_where_the_kernel_runs(monkeypatch):
    from deepshard.runtime.optim import build as build_module

    model = torch.nn.Linear(4, 3)
    params = {"lr": 0.02, "weight_decay": 0.01, "max_grad_norm": 1.0, "betas": [0.8, 0.9]}
    assert type(build_module.build_optimizer("LAMB", params, model.parameters())) is Lamb
    # As on a GPU with CuPy; the CPU tensors then take KernelLamb's reference path.
    monkeypatch.setattr(build_module, "_lamb_kernel_usable", lambda groups: True)
    opt = build_module.build_optimizer("LAMB", params, model.parameters())
    assert type(opt) is KernelLamb
    assert opt.defaults["max_grad_norm"] == 1.0 and opt.defaults["betas"] == (0.8, 0.9)


def test_kernel_lamb_refuses_amsgrad_and_bad_coeffs():
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="amsgrad"):
        KernelLamb(params, amsgrad=True)
    with pytest.raises(ValueError, match="min_coeff"):
        KernelLamb(params, min_coeff=2.0, max_coeff=1.0)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_lamb_cu_compiles_with_every_instantiation(arch, tmp_path):
    entries = ptx_entries("lamb.cu", arch, tmp_path)
    assert len(entries) == 7, entries
    for kernel in ("lamb_update", "lamb_apply"):
        for mangled in ("IfE", "I6__halfE", "I13__nv_bfloat16E"):
            assert any(kernel + mangled in e for e in entries), (kernel, mangled)
    assert any("lamb_ratio" in e for e in entries)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["default", "eps_inside_sqrt", "clamped_max"])
def test_kernel_matches_reference_on_gpu(dtype, case):
    hp = {k: v for k, v in CASES[case].items()}
    kw = dict(lr=hp.pop("lr"), beta1=0.9, beta2=0.999, eps=hp.pop("eps", 1e-8),
              weight_decay=hp.pop("weight_decay", 0.0), **hp)
    sizes = [1, 7, 1000003, *range(100, 140)]  # odd sizes, many tensors, several chunks
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in sizes]
    params.append(torch.zeros(33, device="cuda", dtype=dtype))  # ||p|| = 0: ratio 1
    ref_params = [p.clone() for p in params]
    state = [[torch.zeros(p.numel(), device="cuda") for p in params] for _ in range(2)]
    ref_state = [[t.clone() for t in col] for col in state]
    divisor = torch.tensor(1.7, device="cuda")  # as KernelLamb passes a clipping divisor
    for step in (1, 2, 3):
        grads = [torch.randn(p.numel(), device="cuda", generator=gen).to(dtype) for p in params]
        fused_lamb_step(params, grads, state[0], state[1], step=step, grad_divisor=divisor, **kw)
        lamb_reference(ref_params, grads, ref_state[0], ref_state[1], step=step,
                       grad_divisor=divisor, **kw)
    eps = torch.finfo(dtype).eps
    tol = 1e-5 if dtype == torch.float32 else 2 * eps
    for p, r, s in zip(params, ref_params, state[0], strict=True):
        torch.testing.assert_close(p.float(), r.float(), rtol=tol, atol=tol,
                                   msg=f"{p.numel()} elements")
        assert s.abs().sum() > 0  # the moments were written
    for ours, ref in zip(state, ref_state, strict=True):
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
