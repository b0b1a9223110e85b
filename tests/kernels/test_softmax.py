"""Scaled masked softmax: the references and autograd Function against torch, mask layout
checks, nvcc on the source, and (where a GPU and CuPy are) the kernels against the reference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from deepshard.kernels import loader
from deepshard.kernels import softmax as sm
from tests.kernels.support import needs_gpu, ptx_entries

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (2e-3, 1e-4), torch.bfloat16: (1.6e-2, 1e-3)}
SCALE = 0.37


def _padding(batch, k, keep, device="cpu"):
    """[B, 1, 1, K] additive mask: batch b sees its first keep[b] columns."""
    mask = torch.zeros(batch, 1, 1, k, device=device)
    for b, n in enumerate(keep):
        mask[b, ..., n:] = -math.inf
    return mask


def _torch_oracle(x, mask, scale, causal):
    z = x.float() * scale
    if mask is not None:
        z = z + mask.float()
    if causal:
        q, k = x.shape[-2:]
        z = z.masked_fill(torch.ones(q, k, dtype=torch.bool, device=x.device).triu(1),
                          -math.inf)
    return torch.softmax(z, -1)


# (scores shape, mask builder or None, causal); no row fully masked.
LAYOUTS = {
    "plain": ((3, 7), None, False),
    "full-mask": ((2, 3, 5, 6), lambda s: torch.where(torch.rand(s) < 0.3, -math.inf, 0.0)
                  .index_fill(-1, torch.tensor([0]), 0.0), False),
    "padding": ((2, 3, 4, 9), lambda s: _padding(2, 9, [9, 4]), False),
    "shared-row": ((2, 3, 4, 9), lambda s: _padding(1, 9, [5]), False),
    "causal": ((2, 3, 6, 6), None, True),
    "causal-nonsquare": ((1, 2, 4, 7), None, True),
    "causal+padding": ((2, 1, 5, 5), lambda s: _padding(2, 5, [5, 3]), True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reference_matches_torch(dtype, layout):
    shape, make_mask, causal = LAYOUTS[layout]
    torch.manual_seed(0)
    x = (torch.randn(shape) * 4).to(dtype)
    mask = make_mask(shape) if make_mask else None
    y = sm.scaled_masked_softmax_reference(x, mask, SCALE, causal)
    expected = _torch_oracle(x, mask, SCALE, causal)
    assert not expected.isnan().any()  # the layouts above never mask a whole row
    rtol, atol = TOL[dtype]
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y, expected.to(dtype), rtol=rtol, atol=atol)
    torch.testing.assert_close(y.float().sum(-1), torch.ones(shape[:-1]), rtol=0,
                               atol=10 * rtol)
    if causal:
        q, k = shape[-2:]
        assert (y.float()[..., torch.ones(q, k, dtype=torch.bool).triu(1)] == 0).all()

    xf = x.float().requires_grad_()
    dy = torch.randn(shape)
    _torch_oracle(xf, mask, SCALE, causal).backward(dy)
    dx = sm.scaled_masked_softmax_backward_reference(dy.to(dtype), y, SCALE)
    assert dx.dtype == dtype
    torch.testing.assert_close(dx, xf.grad.to(dtype), rtol=rtol * 4, atol=atol * 40)


def test_fully_masked_rows_give_zeros_not_nan():
    x = torch.randn(2, 2, 3, 4, requires_grad=True)
    mask = _padding(2, 4, [4, 0])  # batch 1 sees nothing
    y = sm.scaled_masked_softmax(x, mask, SCALE)
    assert torch.softmax(x.detach() * SCALE + mask, -1)[1].isnan().all()  # what torch does
    assert (y[1] == 0).all() and not y.isnan().any()
    torch.testing.assert_close(y[0], torch.softmax(x.detach()[0] * SCALE, -1))
    y.backward(torch.randn_like(y))
    assert (x.grad[1] == 0).all() and x.grad[0].abs().sum() > 0


@pytest.mark.parametrize("layout", ["padding", "causal+padding", "full-mask"])
def test_autograd_function_on_cpu_matches_torch(layout):
    shape, make_mask, causal = LAYOUTS[layout]
    torch.manual_seed(1)
    x, dy = torch.randn(shape), torch.randn(shape)
    mask = make_mask(shape)
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = sm.scaled_masked_softmax(mine, mask, SCALE, causal)
    y_t = _torch_oracle(theirs, mask, SCALE, causal)
    torch.testing.assert_close(y, y_t)
    y.backward(dy)
    y_t.backward(dy)
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("x_shape", "mask_shape"), [
    ((2, 3, 4, 5), (2, 3, 1, 5)),  # head-dependent mask: not a supported layout
    ((2, 3, 4, 5), (3, 1, 1, 5)),  # batch mismatch
    ((2, 3, 4, 5), (1, 5)),        # fewer dimensions: spell out the broadcast
    ((2, 3, 4, 5), (2, 1, 1, 4)),  # wrong key length
])
def test_unsupported_mask_layouts_are_refused(x_shape, mask_shape):
    with pytest.raises(ValueError, match="unsupported mask shape"):
        sm.scaled_masked_softmax(torch.zeros(x_shape), torch.zeros(mask_shape))


def test_mask_group_counts_rows_per_mask_row():
    x = torch.zeros(2, 3, 4, 5)
    assert sm.mask_group(x, None) == 1
    assert sm.mask_group(x, torch.zeros(2, 3, 4, 5)) == 1
    assert sm.mask_group(x, torch.zeros(2, 1, 1, 5)) == 12
    assert sm.mask_group(x, torch.zeros(1, 1, 1, 5)) == 24


def test_boolean_masks_and_1d_causal_are_refused():
    with pytest.raises(TypeError, match="additive"):
        sm.scaled_masked_softmax(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal"):
        sm.scaled_masked_softmax(torch.zeros(5), causal=True)


def test_bench_cases_describe_bandwidth():
    cases = sm.bench_cases("meta")  # shapes and byte counts without allocating
    assert len(cases) == 6
    fwd = next(c for c in cases if c.name == "softmax fwd float16 4x16x2048x2048 causal")
    assert fwd.bytes_moved == 2 * 4 * 16 * 2048 * 2048 * 2


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_source_compiles_with_every_instantiation(arch, tmp_path: Path):
    entries = ptx_entries(sm.SOURCE, arch, tmp_path)
    assert len(entries) == len(sm.NAME_EXPRESSIONS) == 6
    for d in ("fwd", "bwd"):
        for mangled in ("f", "6__half", "13__nv_bfloat16"):
            assert any(f"scaled_masked_softmax_{d}I{mangled}E" in e for e in entries)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "mask_keep", "causal"), [
    ((1, 1), None, False), ((3, 7), None, False), ((3, 1000), None, False),
    ((3, 4097), None, False), ((4096, 1024), None, False),
    ((2, 4, 64, 1000), [1000, 13], False),   # padding mask, many rows
    ((2, 2, 3, 4097), [4097, 0], False),     # batch 1 fully masked: zeros
    ((2, 3, 37, 37), None, True), ((1, 2, 5, 9), None, True),
    ((2, 1, 33, 33), [33, 7], True),
])
def test_kernel_matches_reference(dtype, shape, mask_keep, causal):
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(shape, generator=gen, device="cuda") * 4).to(dtype)
    dy = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    mask = None if mask_keep is None else _padding(shape[0], shape[-1], mask_keep, "cuda")
    assert loader.cuda_ready(x)
    rtol, atol = TOL[dtype]
    y = sm.scaled_masked_softmax_forward(x, mask, SCALE, causal)
    y_ref = sm.scaled_masked_softmax_reference(x, mask, SCALE, causal)
    assert not y.isnan().any()
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
    if mask_keep is not None and 0 in mask_keep:
        assert (y[mask_keep.index(0)] == 0).all()
    dx = sm.scaled_masked_softmax_backward(dy, y_ref, SCALE)
    dx_ref = sm.scaled_masked_softmax_backward_reference(dy, y_ref, SCALE)
    torch.testing.assert_close(dx, dx_ref, rtol=rtol * 4, atol=atol * 10)
