"""Fused Adam: the reference against torch's optimizers, nvcc compiles the kernel, and (on a
GPU with CuPy) the kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from deepshard.kernels.adam import adam_reference, fused_adam_step
from deepshard.runtime.optim.adam import KernelAdam
from tests.kernels.support import needs_gpu, ptx_entries

HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8)
SIZES = (1, 7, 300, 4097)


def _grads(sizes, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in sizes] for _ in range(steps)]


def _params(sizes, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in sizes]


@pytest.mark.parametrize(("decoupled", "wd"), [(True, 0.1), (False, 0.1), (True, 0.0)])
def test_reference_matches_torch_fp32(decoupled, wd):
    start = _params(SIZES)
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(theirs, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
              weight_decay=wd, foreach=False)
    ours = [p.clone() for p in start]
    ms = [torch.zeros_like(p) for p in ours]
    vs = [torch.zeros_like(p) for p in ours]
    for step, grads in enumerate(_grads(SIZES, 5), start=1):
        for p, g in zip(theirs, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        adam_reference(ours, grads, ms, vs, step=step, weight_decay=wd, decoupled=decoupled,
                       **HP)
    for a, b, s in zip(ours, theirs, start, strict=True):
        assert not torch.equal(a, s)  # the steps moved the parameters
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)


def _master_run(dtype, decoupled, steps=5):
    """Low-precision params with fp32 state through the reference, and an fp32 master copy
    through torch's own Adam/AdamW on the same (rounded) gradients."""
    start = [p.to(dtype) for p in _params(SIZES)]
    low = [p.clone() for p in start]
    master = [torch.nn.Parameter(p.float()) for p in start]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(master, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
              weight_decay=0.1, foreach=False)
    ms, vs = [torch.zeros(s) for s in SIZES], [torch.zeros(s) for s in SIZES]
    for step, grads in enumerate(_grads(SIZES, steps), start=1):
        low_grads = [g.to(dtype) for g in grads]
        adam_reference(low, low_grads, ms, vs, step=step, weight_decay=0.1,
                       decoupled=decoupled, **HP)
        for p, g in zip(master, low_grads, strict=True):
            p.grad = g.float()
        opt.step()
    return start, low, [p.detach() for p in master], steps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_reference_low_precision_params_follow_fp32_master(dtype, decoupled):
    start, low, master, steps = _master_run(dtype, decoupled)
    # One rounding to dtype per step, each at most half an ulp of the parameter.
    tol = steps * torch.finfo(dtype).eps
    for p, m, s in zip(low, master, start, strict=True):
        assert p.dtype == dtype
        assert (p.float() - s.float()).abs().max() > 4 * HP["lr"] * 0.5  # it moved
        torch.testing.assert_close(p.float(), m, rtol=tol, atol=tol)


def test_kernel_adam_on_cpu_matches_torch_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    twin.load_state_dict(model.state_dict())
    ours = KernelAdam(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.05)
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2, betas=(0.8, 0.95),
                               weight_decay=0.05, foreach=False)
    x, y = torch.randn(16, 5), torch.randn(16, 3)
    for _ in range(4):
        for net, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    state = ours.state[next(model.parameters())]
    assert state["step"] == 4 and state["exp_avg"].dtype == torch.float32


def test_kernel_adam_refuses_amsgrad():
    with pytest.raises(ValueError, match="amsgrad"):
        KernelAdam([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_adam_cu_compiles_with_every_instantiation(arch, tmp_path):
    entries = ptx_entries("adam.cu", arch, tmp_path)
    assert len(entries) == 3, entries
    assert any("adam_stepIfE" in e for e in entries)
    assert any("6__half" in e for e in entries)
    assert any("13__nv_bfloat16" in e for e in entries)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_kernel_matches_reference_on_gpu(dtype, decoupled):
    sizes = [1, 7, 1000003, *range(100, 140)]  # odd sizes, many tensors, several chunks
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in sizes]
    ref_params = [p.clone() for p in params]
    state = [[torch.rand(s, device="cuda", generator=gen) for s in sizes] for _ in range(2)]
    ref_state = [[t.clone() for t in col] for col in state]
    for step in (1, 2, 3):
        grads = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in sizes]
        kw = dict(step=step, weight_decay=0.1, decoupled=decoupled, **HP)
        fused_adam_step(params, grads, state[0], state[1], **kw)
        adam_reference(ref_params, grads, ref_state[0], ref_state[1], **kw)
    eps = torch.finfo(dtype).eps
    for p, r, s in zip(params, ref_params, sizes, strict=True):
        # fp32: a few ulps of reordering; fp16/bf16: one rounding of the param dtype.
        tol = 1e-5 if dtype == torch.float32 else 2 * eps
        torch.testing.assert_close(p.float(), r.float(), rtol=tol, atol=tol, msg=f"size {s}")
    for ours, ref in zip(state, ref_state, strict=True):
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
