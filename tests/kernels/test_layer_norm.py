"""LayerNorm: the reference and autograd Function against torch, nvcc on the source, and
(where a GPU and CuPy are) the kernels against the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepshard.kernels import layer_norm as ln
from deepshard.kernels import loader
from tests.kernels.support import needs_gpu, ptx_entries

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Output-rounding-scaled tolerances (rtol, atol) per dtype.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _inputs(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    cols = shape[-1]
    x = torch.randn(shape, generator=gen, device=device) * 3 + 1
    w = torch.randn(cols, generator=gen, device=device)
    b = torch.randn(cols, generator=gen, device=device)
    dy = torch.randn(shape, generator=gen, device=device)
    return [t.to(dtype) for t in (x, w, b, dy)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 64), (1, 1000), (4, 1)])
def test_reference_matches_torch(dtype, shape):
    x, w, b, dy = _inputs(shape, dtype)
    y, mean, rstd = ln.layer_norm_reference(x, w, b, 1e-5)
    expected = F.layer_norm(x.float(), shape[-1:], w.float(), b.float(), 1e-5).to(dtype)
    rtol, atol = TOL[dtype]
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y, expected, rtol=rtol, atol=atol)
    torch.testing.assert_close(mean, x.float().reshape(-1, shape[-1]).mean(-1))
    var = x.float().reshape(-1, shape[-1]).var(-1, unbiased=False)
    torch.testing.assert_close(rstd, torch.rsqrt(var + 1e-5))

    xf, wf, bf = (t.float().requires_grad_() for t in (x, w, b))
    F.layer_norm(xf, shape[-1:], wf, bf, 1e-5).backward(dy.float())
    dx, dgamma, dbeta = ln.layer_norm_backward_reference(dy, x, w, mean, rstd)
    assert (dx.dtype, dgamma.dtype) == (dtype, dtype)
    # Gradient sums over rows: scale the tolerance with the magnitude.
    torch.testing.assert_close(dx, xf.grad.to(dtype), rtol=rtol, atol=atol * 10)
    torch.testing.assert_close(dgamma, wf.grad.to(dtype), rtol=rtol, atol=atol * 10)
    torch.testing.assert_close(dbeta, bf.grad.to(dtype), rtol=rtol, atol=atol * 10)


def test_eps_is_used():
    x = torch.tensor([[1.0, -1.0]])  # variance 1
    one, zero = torch.ones(2), torch.zeros(2)
    y, _, rstd = ln.layer_norm_reference(x, one, zero, eps=3.0)
    assert rstd.item() == pytest.approx(0.5)
    torch.testing.assert_close(y, torch.tensor([[0.5, -0.5]]))


def test_autograd_function_on_cpu_matches_torch():
    x, w, b, dy = _inputs((6, 33), torch.float32, seed=1)
    mine = [t.clone().requires_grad_() for t in (x, w, b)]
    theirs = [t.clone().requires_grad_() for t in (x, w, b)]
    y = ln.layer_norm(*mine, eps=1e-6)
    y_t = F.layer_norm(theirs[0], (33,), theirs[1], theirs[2], 1e-6)
    torch.testing.assert_close(y, y_t)
    y.backward(dy)
    y_t.backward(dy)
    for m, t in zip(mine, theirs, strict=True):
        torch.testing.assert_close(m.grad, t.grad, rtol=1e-5, atol=1e-5)


def test_default_weight_and_bias_get_no_gradient():
    x = torch.randn(4, 8, requires_grad=True)
    y = ln.layer_norm(x)
    torch.testing.assert_close(y, F.layer_norm(x, (8,)))
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().max() < 1e-5  # d(sum of normalized)/dx = 0


def test_bench_cases_describe_bandwidth():
    cases = ln.bench_cases("meta")  # shapes and byte counts without allocating
    assert {c.name.split()[1] for c in cases} == {"fwd", "bwd"}
    fwd = next(c for c in cases if c.name == "layer_norm fwd float32 8192x4096")
    assert fwd.bytes_moved == 2 * 8192 * 4096 * 4 + 2 * 4096 * 4 + 8 * 8192


# --- nvcc ---------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_source_compiles_with_every_instantiation(arch, tmp_path: Path):
    entries = ptx_entries(ln.SOURCE, arch, tmp_path)
    for kernel in ln._KERNELS:
        for mangled in ("f", "6__half", "13__nv_bfloat16"):
            assert any(f"{kernel}I{mangled}E" in e for e in entries), (kernel, mangled, entries)
    assert len(entries) == 3 * len(ln._KERNELS)


# --- GPU: kernels against the reference ---------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (3, 1000), (3, 4097), (2048, 1024),
                                   (5, 8192)])
@pytest.mark.gpu
@needs_gpu
def test_kernel_matches_reference(dtype, shape):
    x, w, b, dy = _inputs(shape, dtype, device="cuda", seed=2)
    assert loader.cuda_ready(x, w, b)
    y, mean, rstd = ln.layer_norm_forward(x, w, b, 1e-5)
    y_ref, mean_ref, rstd_ref = ln.layer_norm_reference(x, w, b, 1e-5)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(mean, mean_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol * 4)

    dx, dgamma, dbeta = ln.layer_norm_backward(dy, x, w, mean, rstd)
    dx_ref, dgamma_ref, dbeta_ref = ln.layer_norm_backward_reference(dy, x, w, mean_ref,
                                                                     rstd_ref)
    torch.testing.assert_close(dx, dx_ref, rtol=rtol, atol=atol * 4)
    # Column sums over up to 2048 rows, summed in a different order: scale atol by sqrt(rows).
    scale = max(1.0, shape[0] ** 0.5)
    torch.testing.assert_close(dgamma, dgamma_ref, rtol=rtol * 2, atol=atol * 4 * scale)
    torch.testing.assert_close(dbeta, dbeta_ref, rtol=rtol * 2, atol=atol * 4 * scale)
