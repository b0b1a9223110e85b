"""Int8 weight kernels against the fp32 ``F.linear`` reference (deepshard/inference/quant.py).

Tolerances are relative Frobenius errors against ``F.linear(x, w, b)`` with the *unquantized*
fp32 weight, on Gaussian data. Per-channel int8 weights alone cost ~0.8% (measured), so the
weight-only kernels (int8pack, dequant) get 2%. fbgemm also quantizes the activations per
tensor to 7 bits on the fly (W8A8-dynamic), ~1-2% more, so it gets 5%. bf16/fp16 input adds
its own rounding (~0.4% for bf16): +1%.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from deepshard.errors import UsageValueError
from deepshard.inference.quant import (
    Int8Kernel,
    Int8Weights,
    KernelNotAvailableError,
    choose_kernel,
    dequantize,
    quantization_error,
    quantize_per_channel,
)

TOL = {"dequant": 0.02, "int8pack": 0.02, "fbgemm": 0.05}


def _available_on_cpu(kernel: str) -> bool:
    try:
        return choose_kernel("cpu", kernel) == kernel
    except KernelNotAvailableError:
        return False


CPU_KERNELS = [k for k in ("fbgemm", "int8pack", "dequant") if _available_on_cpu(k)]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def make(out: int, inp: int, bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(out * 1000 + inp)
    w = torch.randn(out, inp, generator=g) * 0.02
    return w, (torch.randn(out, generator=g) * 0.01 if bias else None)


def test_round_trip_within_half_a_step_per_channel() -> None:
    w = torch.randn(40, 33) * torch.logspace(-6, 2, 40)[:, None]  # rows 8 decades apart
    q = quantize_per_channel(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (40, 33)
    assert q.scale.dtype == torch.float32 and q.scale.shape == (40,)
    assert int(q.qweight.abs().max()) <= 127
    err = (w - dequantize(q)).abs()
    assert bool((err <= q.scale[:, None] / 2 * (1 + 1e-5)).all())
    assert quantization_error(w) <= 1 / 254 * (1 + 1e-5)


def test_zero_rows_quantize_to_exact_zeros() -> None:
    w = torch.randn(6, 10)
    w[[0, 3]] = 0.0
    q = quantize_per_channel(w)
    assert bool(torch.isfinite(q.scale).all()) and bool((q.scale > 0).all())
    assert int(q.qweight[[0, 3]].abs().sum()) == 0
    assert bool((dequantize(q)[[0, 3]] == 0).all())
    assert quantization_error(torch.zeros(3, 4)) == 0.0


def test_rejects_what_int8_cannot_hold() -> None:
    with pytest.raises(UsageValueError, match="inf or nan"):
        quantize_per_channel(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(UsageValueError, match="2-D float"):
        quantize_per_channel(torch.ones(3))
    with pytest.raises(UsageValueError, match="HINT"):
        Int8Weights(torch.zeros(2, 3, dtype=torch.int8), torch.ones(3))


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize(("out", "inp"), [(48, 64), (29, 37)])  # 37, 29: not multiples of 8
@pytest.mark.parametrize("lead", [(1,), (8,), (2, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_matches_fp32_linear(kernel: str, out: int, inp: int, lead: tuple[int, ...],
                                    bias: bool) -> None:
    w, b = make(out, inp, bias)
    k = Int8Kernel.build(quantize_per_channel(w), b, kernel)
    assert k.name == kernel
    x = torch.randn(*lead, inp)
    y = k(x)
    assert y.shape == (*lead, out) and y.dtype == torch.float32
    assert rel_err(y, F.linear(x, w, b)) < TOL[kernel]


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inp", [64, 37])  # 37: int8pack's CPU bf16 kernel crashes; must not
def test_half_precision_input_keeps_its_dtype(kernel: str, dtype: torch.dtype, inp: int) -> None:
    w, b = make(24, inp)
    k = Int8Kernel.build(quantize_per_channel(w), b, kernel)
    x = torch.randn(2, 3, inp)
    y = k(x.to(dtype))
    assert y.dtype == dtype and y.shape == (2, 3, 24)
    assert rel_err(y, F.linear(x, w, b)) < TOL[kernel] + 0.01


def test_choose_kernel_auto() -> None:
    engine = torch.backends.quantized.engine
    assert choose_kernel("cpu") == ("fbgemm" if engine in ("x86", "fbgemm") else "dequant")
    assert choose_kernel("meta") == "dequant"
    assert choose_kernel("cuda") in ("int8pack", "dequant")


def test_unavailable_kernel_is_one_line_with_a_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KernelNotAvailableError, match=r"CPU only\. HINT: request kernel 'auto'"):
        choose_kernel("cuda", "fbgemm")
    with pytest.raises(UsageValueError, match="unknown int8 kernel 'int4'"):
        choose_kernel("cpu", "int4")
    if "qnnpack" in torch.backends.quantized.supported_engines:
        monkeypatch.setattr(torch.backends.quantized, "engine", "qnnpack")
        assert choose_kernel("cpu") == "dequant"
        with pytest.raises(KernelNotAvailableError) as info:
            choose_kernel("cpu", "fbgemm")
        assert "\n" not in str(info.value) and "HINT: set torch.backends" in str(info.value)


def test_bad_input_is_a_usage_error() -> None:
    k = Int8Kernel.build(quantize_per_channel(torch.randn(5, 7)), None, "dequant")
    with pytest.raises(UsageValueError, match=r"\[\.\.\., 7\]"):
        k(torch.randn(2, 8))
    with pytest.raises(UsageValueError, match="float64"):
        k(torch.randn(2, 7, dtype=torch.float64))


def test_nbytes_counts_int8_weight_scales_and_bias() -> None:
    w, b = make(29, 37)
    k = Int8Kernel.build(quantize_per_channel(w), b)
    assert k.nbytes == 29 * 37 + 29 * 4 + 29 * 4
    assert Int8Kernel.build(quantize_per_channel(w), None).nbytes == 29 * 37 + 29 * 4


class _Layer(torch.nn.Module):
    """How a layer holds int8 weights: buffers are the state, the kernel is derived."""

    def __init__(self, q: Int8Weights, bias: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", q.qweight)
        self.register_buffer("scale", q.scale)
        self.register_buffer("bias", bias)
        self.kernel = Int8Kernel.build(q, bias)


def test_packed_kernel_stays_out_of_state_dict_and_survives_copies() -> None:
    w, b = make(29, 37)
    assert b is not None
    layer = _Layer(quantize_per_channel(w), b)
    assert set(layer.state_dict()) == {"qweight", "scale", "bias"}
    x = torch.randn(3, 37)
    for clone in (copy.deepcopy(layer).kernel, pickle.loads(pickle.dumps(layer.kernel))):
        assert clone.name == layer.kernel.name
        torch.testing.assert_close(clone(x), layer.kernel(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_auto_kernel_matches_fp32_linear(dtype: torch.dtype) -> None:
    w, b = make(29, 37)
    k = Int8Kernel.build(quantize_per_channel(w.cuda()), b.cuda() if b is not None else None)
    x = torch.randn(2, 3, 37)
    y = k(x.cuda().to(dtype))
    assert y.dtype == dtype and rel_err(y.cpu(), F.linear(x, w, b)) < TOL[k.name] + 0.01
