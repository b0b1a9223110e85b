"""Bias + GeLU: the references and autograd Function against torch, nvcc on the source, and
(where a GPU and CuPy are) the kernels against the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepshard.kernels import bias_gelu as bg
from deepshard.kernels import loader
from tests.kernels.support import needs_gpu, ptx_entries

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
APPROX = ["none", "tanh"]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _inputs(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=gen, device=device) * 2
    b = torch.randn(shape[-1], generator=gen, device=device)
    dy = torch.randn(shape, generator=gen, device=device)
    return [t.to(dtype) for t in (x, b, dy)]


@pytest.mark.parametrize("approximate", APPROX)
def test_gelu_grad_formula_matches_autograd_in_float64(approximate):
    u = torch.linspace(-8, 8, 1001, dtype=torch.float64, requires_grad=True)
    F.gelu(u, approximate=approximate).sum().backward()
    torch.testing.assert_close(bg.gelu_grad_reference(u.detach(), approximate), u.grad,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (2, 4, 33), (1, 1000), (5, 1)])
def test_reference_matches_torch(dtype, approximate, shape):
    x, b, dy = _inputs(shape, dtype)
    rtol, atol = TOL[dtype]
    y = bg.bias_gelu_reference(x, b, approximate)
    assert y.dtype == dtype and y.shape == x.shape
    # torch's unfused expression rounds x + b to dtype first: one extra rounding apart.
    torch.testing.assert_close(y, F.gelu(x + b, approximate=approximate), rtol=rtol,
                               atol=atol * 2)
    xf, bf = x.float().requires_grad_(), b.float().requires_grad_()
    F.gelu(xf + bf, approximate=approximate).backward(dy.float())
    dx, dbias = bg.bias_gelu_backward_reference(dy, x, b, approximate)
    assert (dx.dtype, dbias.dtype, dbias.shape) == (dtype, dtype, b.shape)
    torch.testing.assert_close(dx, xf.grad.to(dtype), rtol=rtol, atol=atol)
    rows = x.numel() // shape[-1]
    torch.testing.assert_close(dbias, bf.grad.to(dtype), rtol=rtol, atol=atol * rows)


def test_exact_and_tanh_are_both_honoured():
    u = torch.linspace(-5, 5, 201)
    zero = torch.zeros(201)
    exact = bg.bias_gelu_reference(u, zero, "none")
    tanh = bg.bias_gelu_reference(u, zero, "tanh")
    torch.testing.assert_close(exact, F.gelu(u), rtol=0, atol=0)
    torch.testing.assert_close(tanh, F.gelu(u, approximate="tanh"), rtol=0, atol=0)
    assert (exact - tanh).abs().max().item() > 1e-4  # the flag reaches the math


@pytest.mark.parametrize("approximate", APPROX)
def test_autograd_function_on_cpu_matches_torch(approximate):
    x, b, dy = _inputs((6, 2, 17), torch.float32, seed=3)
    mx, mb = x.clone().requires_grad_(), b.clone().requires_grad_()
    tx, tb = x.clone().requires_grad_(), b.clone().requires_grad_()
    y = bg.bias_gelu(mx, mb, approximate)
    y_t = F.gelu(tx + tb, approximate=approximate)
    torch.testing.assert_close(y, y_t)
    y.backward(dy)
    y_t.backward(dy)
    torch.testing.assert_close(mx.grad, tx.grad)
    torch.testing.assert_close(mb.grad, tb.grad, rtol=1e-5, atol=1e-5)


def test_unknown_approximation_is_refused():
    with pytest.raises(ValueError, match="approximate"):
        bg.bias_gelu(torch.zeros(2, 2), torch.zeros(2), "erf")


def test_bench_cases_describe_bandwidth():
    cases = bg.bench_cases("meta")  # shapes and byte counts without allocating
    fwd = next(c for c in cases if c.name == "bias_gelu fwd float32 tanh 8192x16384")
    assert fwd.bytes_moved == 2 * 8192 * 16384 * 4 + 16384 * 4
    assert len(cases) == 6


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_source_compiles_with_every_instantiation(arch, tmp_path: Path):
    entries = ptx_entries(bg.SOURCE, arch, tmp_path)
    assert len(entries) == len(bg.NAME_EXPRESSIONS) == 15
    for mangled in ("f", "6__half", "13__nv_bfloat16"):
        for kernel in ("bias_gelu_fwd", "bias_gelu_bwd"):
            for flag in ("Lb0E", "Lb1E"):
                assert any(e.startswith(f"_Z{len(kernel)}{kernel}I{mangled}{flag}")
                           for e in entries), (kernel, mangled, flag)
        assert any(f"bias_gelu_dbias_finalI{mangled}E" in e for e in entries)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (3, 1000), (3, 4097), (4096, 1024),
                                   (2, 3, 8192)])
def test_kernel_matches_reference(dtype, approximate, shape):
    x, b, dy = _inputs(shape, dtype, device="cuda", seed=4)
    assert loader.cuda_ready(x, b)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(bg.bias_gelu_forward(x, b, approximate),
                               bg.bias_gelu_reference(x, b, approximate), rtol=rtol, atol=atol)
    dx, dbias = bg.bias_gelu_backward(dy, x, b, approximate)
    dx_ref, dbias_ref = bg.bias_gelu_backward_reference(dy, x, b, approximate)
    torch.testing.assert_close(dx, dx_ref, rtol=rtol, atol=atol)
    rows = x.numel() // shape[-1]
    torch.testing.assert_close(dbias, dbias_ref, rtol=rtol * 2, atol=atol * max(1, rows**0.5))
