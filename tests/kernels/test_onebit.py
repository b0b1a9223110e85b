"""1-bit sign packing: the references' layout and round trip, nvcc on the source, and (where a
GPU and CuPy are) the kernels against the references, bit for bit."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from deepshard.kernels import loader
from deepshard.kernels import onebit as ob
from tests.kernels.support import needs_gpu, ptx_entries

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 8, 9, 1000, 4097]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_keeps_signs_and_sets_magnitudes_to_the_scale(dtype, n):
    torch.manual_seed(n)
    x = torch.randn(n).to(dtype)
    bits, scale, numel = ob.pack_reference(x)
    assert (bits.dtype, bits.shape, numel) == (torch.uint8, ((n + 7) // 8,), n)
    assert scale.dtype == torch.float32 and scale.ndim == 0
    torch.testing.assert_close(scale, x.float().abs().mean())
    y = ob.unpack_reference(bits, scale, numel, dtype)
    assert y.dtype == dtype and y.shape == (n,)
    assert torch.equal(y > 0, x >= 0)
    assert torch.equal(y.float().abs(), scale.to(dtype).float().expand(n))


@pytest.mark.parametrize("n", SIZES)
def test_bit_order_is_numpys_little_endian_packbits(n):
    torch.manual_seed(100 + n)
    x = torch.randn(n)
    bits, _, _ = ob.pack_reference(x)
    expected = np.packbits((x >= 0).numpy(), bitorder="little")  # pads with 0 bits
    assert bits.tolist() == expected.tolist()


def test_bit_layout_by_hand():
    x = torch.tensor([1.0, -1, -1, 2, -1, -1, -1, -3, 0.5])
    bits, scale, n = ob.pack_reference(x)
    # Element 0 is the least significant bit; element 8 starts byte 1; padding bits are 0.
    assert bits.tolist() == [0b0000_1001, 0b0000_0001]
    assert scale.item() == pytest.approx(11.5 / 9)
    assert ob.unpack_reference(bits, scale, n).tolist() == pytest.approx(
        [s * 11.5 / 9 for s in (1, -1, -1, 1, -1, -1, -1, -1, 1)])


def test_negative_zero_is_non_negative_and_nan_is_not():
    bits, _, _ = ob.pack_reference(torch.tensor([-0.0, math.nan, 0.0]))
    assert bits.tolist() == [0b101]


def test_multidimensional_input_packs_in_memory_order():
    x = torch.tensor([[1.0, -1.0, 1.0], [-1.0, -1.0, 1.0]])
    bits, scale, n = ob.pack_reference(x)
    assert (bits.tolist(), n) == ([0b100101], 6)
    assert ob.unpack_reference(bits, scale, n).reshape(2, 3).sign().tolist() == x.tolist()


def test_empty_tensor():
    bits, scale, n = ob.pack(torch.empty(0))
    assert (bits.numel(), scale.item(), n) == (0, 0.0, 0)
    assert ob.unpack(bits, scale, 0).shape == (0,)


def test_error_feedback_is_left_to_callers():
    # What a 1-bit optimizer does with these: the residual carries what the code lost.
    torch.manual_seed(2)
    x = torch.randn(37)
    bits, scale, n = ob.pack(x)
    residual = x - ob.unpack(bits, scale, n)
    assert residual.abs().max() > 0
    torch.testing.assert_close(ob.unpack(bits, scale, n) + residual, x)


def test_bits_of_the_wrong_length_are_refused():
    bits, scale, _ = ob.pack_reference(torch.randn(9))
    with pytest.raises(ValueError, match=r"uint8 of shape \(1,\)"):
        ob.unpack(bits, scale, 8)


def test_bench_cases_describe_bandwidth():
    cases = ob.bench_cases("meta")  # shapes and byte counts without allocating
    assert len(cases) == 4
    pack = next(c for c in cases if c.name == "onebit pack float32 268435456")
    assert pack.bytes_moved == 2**28 * 4 + 2**28 // 8 + 4


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_source_compiles_with_every_instantiation(arch, tmp_path: Path):
    entries = ptx_entries(ob.SOURCE, arch, tmp_path)
    assert len(entries) == len(ob.NAME_EXPRESSIONS) == 7
    assert any(e.startswith("_Z12onebit_scale") for e in entries)
    for d in ("pack", "unpack"):
        for mangled in ("f", "6__half", "13__nv_bfloat16"):
            assert any(f"onebit_{d}I{mangled}E" in e for e in entries)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [*SIZES, 33, 3 * 4097, 10_000_001])
def test_kernels_match_reference(dtype, n):
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, generator=gen, device="cuda").to(dtype)
    x[: min(n, 3)] = 0.0  # zeros pack as 1
    assert loader.cuda_ready(x)
    bits, scale, numel = ob.pack(x)
    bits_ref, scale_ref, _ = ob.pack_reference(x)
    assert numel == n
    assert torch.equal(bits, bits_ref)  # bit for bit, padding included
    torch.testing.assert_close(scale, scale_ref, rtol=1e-5, atol=0)
    y = ob.unpack(bits, scale_ref, n, dtype)
    assert torch.equal(y, ob.unpack_reference(bits_ref, scale_ref, n, dtype))


@pytest.mark.gpu
@needs_gpu
def test_kernel_packs_a_non_contiguous_tensor_in_logical_order():
    x = torch.randn(64, 33, device="cuda").t()
    bits, _, _ = ob.pack(x)
    assert torch.equal(bits, ob.pack_reference(x.contiguous())[0])
