"""ZeRO++'s block quantizer: the error bound it states, packing, and the dtypes it serves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepshard.runtime.zero.quantize import QMAX, pack, packed_bytes, quantize, roundtrip


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 700), block=st.sampled_from([16, 64, 256]), bits=st.sampled_from([8, 4]),
       seed=st.integers(0, 2**31 - 1), spread=st.floats(1e-6, 1e4))
def test_every_element_is_within_half_a_step_of_its_block(n, block, bits, seed, spread):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * spread
    back = roundtrip(x, block, bits)
    pad = torch.nn.functional.pad(x, (0, (-n) % block)).view(-1, block)
    bound = pad.abs().amax(dim=1) / (2 * QMAX[bits])
    err = (back - x).abs()
    per_element = bound.repeat_interleave(block)[:n]
    assert torch.all(err <= per_element * (1 + 1e-5) + 1e-30)


def test_zeros_and_block_maxima_are_exact():
    x = torch.zeros(300)
    x[5], x[260] = 3.0, -0.5
    back = roundtrip(x, 256, 8)
    assert back[5] == 3.0 and back[260] == -0.5 and torch.count_nonzero(back) == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [8, 4])
def test_packed_sizes_and_dtypes(dtype, bits):
    x = torch.randn(1000).to(dtype)
    values, scales = quantize(x, 128, bits)
    buf = pack(values, scales, bits)
    assert buf.dtype == torch.uint8 and buf.numel() == packed_bytes(1000, 128, bits)
    assert buf.numel() == 8 * 128 * bits // 8 + 4 * 8  # 8 blocks
    back = roundtrip(x, 128, bits)
    assert back.dtype == dtype and back.shape == x.shape
    tol = x.float().abs().max() / QMAX[bits]
    assert (back.float() - x.float()).abs().max() <= tol
