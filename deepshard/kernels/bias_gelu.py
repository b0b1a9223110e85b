"""Fused bias + GeLU (``cuda/bias_gelu.cu``) and its torch references.

``bias_gelu(x, bias, approximate)`` equals ``F.gelu(x + bias, approximate=approximate)`` with
``bias`` of shape ``[x.shape[-1]]``; ``approximate`` is ``"none"`` (exact erf) or ``"tanh"``.
The sum ``x + bias`` is kept in fp32 (torch rounds it to x's dtype first), so half-precision
results may differ from the unfused torch expression by one rounding of the sum.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from deepshard.kernels import loader
from deepshard.kernels.bench import BenchCase

SOURCE = "bias_gelu.cu"
_MAX_PARTS = 128
"""Row groups of the dbias first pass (partial buffer: parts × cols floats)."""
_APPROXIMATE = {"none": "false", "tanh": "true"}


def _check_approximate(approximate: str) -> None:
    if approximate not in _APPROXIMATE:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor,
                        approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)`` computed in fp32, returned in x's dtype."""
    _check_approximate(approximate)
    return F.gelu(x.float() + bias.float(), approximate=approximate).to(x.dtype)


def gelu_grad_reference(u: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """d gelu(u) / du, in closed form (the formula the kernel uses)."""
    _check_approximate(approximate)
    if approximate == "tanh":
        k = math.sqrt(2.0 / math.pi)
        t = torch.tanh(k * (u + 0.044715 * u**3))
        return 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * k * (1 + 3 * 0.044715 * u * u)
    return 0.5 * (1 + torch.erf(u / math.sqrt(2.0))) + u * torch.exp(-0.5 * u * u) / math.sqrt(
        2.0 * math.pi)


def bias_gelu_backward_reference(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                                 approximate: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dbias)``: dx in x's dtype, dbias the fp32 sum over rows of that dx."""
    u = x.float() + bias.float()
    dx = (dy.float() * gelu_grad_reference(u, approximate)).to(x.dtype)
    dbias = dx.float().reshape(-1, x.shape[-1]).sum(0).to(bias.dtype)
    return dx, dbias


def _names(ctype: str, approximate: str) -> tuple[str, str, str]:
    """Name expressions of the forward, backward and dbias kernels for one C type."""
    tanh = _APPROXIMATE[approximate]
    return (f"bias_gelu_fwd<{ctype}, {tanh}>", f"bias_gelu_bwd<{ctype}, {tanh}>",
            f"bias_gelu_dbias_final<{ctype}>")


NAME_EXPRESSIONS = tuple(sorted({n for t in loader.CUDA_TYPES.values() for a in _APPROXIMATE
                                 for n in _names(t, a)}))
"""Every instantiation the module compiles (once per device)."""


def _fn(x: torch.Tensor, name: str):
    return loader.kernel(SOURCE, name, x.device, name_expressions=NAME_EXPRESSIONS)


def _check(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> None:
    _check_approximate(approximate)
    if x.dtype not in loader.CUDA_TYPES or bias.dtype != x.dtype:
        raise TypeError(f"bias_gelu kernels take x and bias of one dtype among float32/float16/"
                        f"bfloat16, got {x.dtype} and {bias.dtype}")
    if x.ndim == 0 or bias.shape != (x.shape[-1],):
        raise ValueError(f"bias must have shape ({x.shape[-1] if x.ndim else '?'},), "
                         f"got {tuple(bias.shape)}")
    if not 0 < x.shape[-1] < 2**31 or x.numel() // x.shape[-1] >= 2**31:
        raise ValueError(f"bias_gelu needs 1 <= columns and rows < 2**31, got {tuple(x.shape)}")


def bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor,
                      approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)`` as :func:`bias_gelu_reference`; the kernel when on a GPU."""
    if not loader.cuda_ready(x, bias):
        return bias_gelu_reference(x, bias, approximate)
    _check(x, bias, approximate)
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n = xc.numel()
    if n:
        blocks = min((n + 255) // 256, 1 << 20)  # grid-stride loop covers the rest
        fwd = _names(loader.CUDA_TYPES[x.dtype], approximate)[0]
        loader.launch(_fn(x, fwd), (blocks,), (256,),
                      (loader.ptr(xc), loader.ptr(bias.contiguous()), loader.ptr(y),
                       np.uint64(n), np.int32(x.shape[-1])))
    return y


def bias_gelu_backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                       approximate: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dbias)`` as :func:`bias_gelu_backward_reference`."""
    if not loader.cuda_ready(dy, x, bias):
        return bias_gelu_backward_reference(dy, x, bias, approximate)
    _check(x, bias, approximate)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError("bias_gelu backward needs dy with x's shape and dtype")
    cols = x.shape[-1]
    x2, dy2 = x.contiguous().view(-1, cols), dy.contiguous().view(-1, cols)
    rows = x2.shape[0]
    dx, dbias = torch.empty_like(x2), torch.empty_like(bias)
    if rows == 0:
        return dx.view(x.shape), dbias.zero_()
    parts = min(rows, _MAX_PARTS)
    partial = torch.empty(parts, cols, device=x.device, dtype=torch.float32)
    col_blocks = (cols + 255) // 256
    _, bwd, final = _names(loader.CUDA_TYPES[x.dtype], approximate)
    loader.launch(_fn(x, bwd), (col_blocks, parts), (256,),
                  (loader.ptr(dy2), loader.ptr(x2), loader.ptr(bias.contiguous()),
                   loader.ptr(dx), loader.ptr(partial), np.int32(rows), np.int32(cols)))
    loader.launch(_fn(x, final), (col_blocks,), (256,),
                  (loader.ptr(partial), loader.ptr(dbias), np.int32(parts), np.int32(cols)))
    return dx.view(x.shape), dbias


class BiasGeluFunction(torch.autograd.Function):
    """Autograd over :func:`bias_gelu_forward` / :func:`bias_gelu_backward`."""

    @staticmethod
    def forward(ctx, x, bias, approximate):
        ctx.approximate = approximate
        ctx.save_for_backward(x, bias)
        return bias_gelu_forward(x, bias, approximate)

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx, dbias = bias_gelu_backward(dy, x, bias, ctx.approximate)
        return dx, dbias, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x + bias, approximate=approximate)``, fused, with gradients for x and bias."""
    _check_approximate(approximate)
    return BiasGeluFunction.apply(x, bias, approximate)


def bench_cases(device: torch.device | str) -> list[BenchCase]:
    """Forward and backward of an MLP's up-projection output, against torch's unfused pair."""
    cases = []
    for dtype, approximate in ((torch.bfloat16, "tanh"), (torch.float16, "none"),
                               (torch.float32, "tanh")):
        rows, cols = 8192, 16384
        x = torch.randn(rows, cols, device=device, dtype=dtype)
        dy = torch.randn_like(x)
        b = torch.randn(cols, device=device, dtype=dtype)
        size, es = rows * cols, x.element_size()
        tag = f"{str(dtype).removeprefix('torch.')} {approximate} {rows}x{cols}"
        cases.append(BenchCase(
            f"bias_gelu fwd {tag}", 2 * size * es + cols * es,
            lambda x=x, b=b, a=approximate: bias_gelu_forward(x, b, a),
            lambda x=x, b=b, a=approximate: F.gelu(x + b, approximate=a), "F.gelu(x + b)"))
        cases.append(BenchCase(
            f"bias_gelu bwd {tag}", 3 * size * es + 2 * cols * es,
            lambda dy=dy, x=x, b=b, a=approximate: bias_gelu_backward(dy, x, b, a),
            lambda dy=dy, x=x, b=b, a=approximate: _torch_backward(dy, x, b, a),
            "aten.gelu_backward(x + b) + sum"))
    return cases


def _torch_backward(dy, x, b, approximate):
    dx = torch.ops.aten.gelu_backward(dy, x + b, approximate=approximate)
    return dx, dx.sum(0)
