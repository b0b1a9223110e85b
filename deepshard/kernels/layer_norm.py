"""LayerNorm over the last dimension: CUDA kernels (``cuda/layer_norm.cu``) and torch references.

``layer_norm`` is the autograd entry point; ``layer_norm_forward`` / ``layer_norm_backward``
dispatch to the kernels when :func:`loader.cuda_ready` and to the fp32 torch references
otherwise (the CPU path, and the oracle the tests compare the kernels with).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from deepshard.kernels import loader
from deepshard.kernels.bench import BenchCase

SOURCE = "layer_norm.cu"
_KERNELS = ("layer_norm_fwd", "layer_norm_bwd_dx", "layer_norm_bwd_params_partial",
            "layer_norm_bwd_params_final")
_MAX_PARTS = 128
"""Row groups of the dgamma/dbeta first pass (partial buffer: parts × cols floats)."""


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)``: y in x's dtype and shape, mean and rstd fp32 of shape [rows]."""
    cols = x.shape[-1]
    xf = x.reshape(-1, cols).float()
    mean = xf.mean(-1)
    rstd = torch.rsqrt((xf - mean[:, None]).square().mean(-1) + eps)
    y = (xf - mean[:, None]) * rstd[:, None] * weight.float() + bias.float()
    return y.to(x.dtype).reshape(x.shape), mean, rstd


def layer_norm_backward_reference(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                  mean: torch.Tensor, rstd: torch.Tensor,
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dgamma, dbeta)`` from the forward's saved mean and rstd, in fp32 math."""
    cols = x.shape[-1]
    dyf, xf = dy.reshape(-1, cols).float(), x.reshape(-1, cols).float()
    xhat = (xf - mean[:, None]) * rstd[:, None]
    g = dyf * weight.float()
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    dgamma, dbeta = (dyf * xhat).sum(0), dyf.sum(0)
    return dx.to(x.dtype).reshape(x.shape), dgamma.to(weight.dtype), dbeta.to(weight.dtype)


def _threads(cols: int) -> int:
    # About 8 elements per thread, whole warps, at most one 1024-thread block per row.
    return min(1024, max(32, (cols + 8 * 32 - 1) // (8 * 32) * 32))


def _fn(name: str, x: torch.Tensor):
    expr = f"{name}<{loader.CUDA_TYPES[x.dtype]}>"
    return loader.kernel(SOURCE, expr, x.device, name_expressions=[
        f"{k}<{t}>" for k in _KERNELS for t in loader.CUDA_TYPES.values()])


def _check(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor) -> None:
    cols = x.shape[-1]
    if x.dtype not in loader.CUDA_TYPES:
        raise TypeError(f"layer_norm kernels take float32/float16/bfloat16, not {x.dtype}")
    if weight.shape != (cols,) or any(t.shape != (cols,) for t in others):
        raise ValueError(f"weight and bias must have shape ({cols},), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype or any(t.dtype != x.dtype for t in others):
        raise TypeError("layer_norm kernels need weight and bias in the input's dtype")
    if not 0 < cols < 2**31:
        raise ValueError(f"layer_norm needs 1 <= columns < 2**31, got {cols}")


def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)`` as :func:`layer_norm_reference`; the kernel when on a GPU."""
    if not loader.cuda_ready(x, weight, bias):
        return layer_norm_reference(x, weight, bias, eps)
    _check(x, weight, bias)
    cols = x.shape[-1]
    x2 = x.contiguous().view(-1, cols)
    rows = x2.shape[0]
    y = torch.empty_like(x2)
    mean = torch.empty(rows, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    w, b = weight.contiguous(), bias.contiguous()  # alive across the launch
    if rows:
        loader.launch(_fn("layer_norm_fwd", x), (rows,), (_threads(cols),),
                      (loader.ptr(x2), loader.ptr(w), loader.ptr(b), loader.ptr(y),
                       loader.ptr(mean),
                       loader.ptr(rstd), np.int32(cols), np.float32(eps)))
    return y.view(x.shape), mean, rstd


def layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        mean: torch.Tensor, rstd: torch.Tensor,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dgamma, dbeta)`` as :func:`layer_norm_backward_reference`."""
    if not loader.cuda_ready(dy, x, weight, mean, rstd):
        return layer_norm_backward_reference(dy, x, weight, mean, rstd)
    _check(x, weight)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError("layer_norm backward needs dy with x's shape and dtype")
    cols = x.shape[-1]
    x2, dy2 = x.contiguous().view(-1, cols), dy.contiguous().view(-1, cols)
    rows = x2.shape[0]
    weight, mean, rstd = weight.contiguous(), mean.contiguous(), rstd.contiguous()
    dx = torch.empty_like(x2)
    dgamma, dbeta = torch.empty_like(weight), torch.empty_like(weight)
    if rows == 0:
        return dx.view(x.shape), dgamma.zero_(), dbeta.zero_()
    threads = _threads(cols)
    loader.launch(_fn("layer_norm_bwd_dx", x), (rows,), (threads,),
                  (loader.ptr(dy2), loader.ptr(x2), loader.ptr(weight), loader.ptr(mean),
                   loader.ptr(rstd), loader.ptr(dx), np.int32(cols)))
    parts = min(rows, _MAX_PARTS)
    partial = torch.empty(2, parts, cols, device=x.device, dtype=torch.float32)
    col_blocks = (cols + 255) // 256
    loader.launch(_fn("layer_norm_bwd_params_partial", x), (col_blocks, parts), (256,),
                  (loader.ptr(dy2), loader.ptr(x2), loader.ptr(mean), loader.ptr(rstd),
                   loader.ptr(partial[0]), loader.ptr(partial[1]), np.int32(rows),
                   np.int32(cols)))
    loader.launch(_fn("layer_norm_bwd_params_final", x), (col_blocks,), (256,),
                  (loader.ptr(partial[0]), loader.ptr(partial[1]), loader.ptr(dgamma),
                   loader.ptr(dbeta), np.int32(parts), np.int32(cols)))
    return dx.view(x.shape), dgamma, dbeta


class LayerNormFunction(torch.autograd.Function):
    """Autograd over :func:`layer_norm_forward` / :func:`layer_norm_backward`."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dgamma, dbeta = layer_norm_backward(dy, x, weight, mean, rstd)
        return dx, dgamma, dbeta, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm(x, x.shape[-1:], weight, bias, eps)`` through the kernels.

    ``weight``/``bias`` default to ones/zeros (then they get no gradient).
    """
    cols = x.shape[-1]
    if weight is None:
        weight = torch.ones(cols, device=x.device, dtype=x.dtype)
    if bias is None:
        bias = torch.zeros(cols, device=x.device, dtype=x.dtype)
    return LayerNormFunction.apply(x, weight, bias, eps)


def bench_cases(device: torch.device | str) -> list[BenchCase]:
    """Forward and backward at transformer widths, against torch's native LayerNorm."""
    cases = []
    for dtype, rows, cols in ((torch.bfloat16, 16384, 4096), (torch.float16, 8192, 8192),
                              (torch.float32, 8192, 4096)):
        x = torch.randn(rows, cols, device=device, dtype=dtype)
        dy = torch.randn_like(x)
        w = torch.randn(cols, device=device, dtype=dtype)
        b = torch.randn(cols, device=device, dtype=dtype)
        _, mean, rstd = layer_norm_reference(x, w, b)
        size, es = rows * cols, x.element_size()
        tag = f"{str(dtype).removeprefix('torch.')} {rows}x{cols}"
        cases.append(BenchCase(
            f"layer_norm fwd {tag}", 2 * size * es + 2 * cols * es + 8 * rows,
            lambda x=x, w=w, b=b: layer_norm_forward(x, w, b),
            lambda x=x, w=w, b=b, cols=cols: F.layer_norm(x, (cols,), w, b), "F.layer_norm"))
        cases.append(BenchCase(
            f"layer_norm bwd {tag}", 3 * size * es + 3 * cols * es + 8 * rows,
            lambda dy=dy, x=x, w=w, m=mean, r=rstd: layer_norm_backward(dy, x, w, m, r),
            lambda dy=dy, x=x, w=w, b=b, m=mean, r=rstd, cols=cols:
                torch.ops.aten.native_layer_norm_backward(
                    dy, x, [cols], m[:, None], r[:, None], w, b, [True, True, True]),
            "aten.native_layer_norm_backward"))
    return cases
