"""Scaled masked softmax (``cuda/softmax.cu``): ``softmax(scale * x + mask)`` along the last
dimension, as attention uses it, with its torch references.

Supported masks (checked, on every path): ``None``; an additive floating mask (0 / -inf or a
large negative) with x's number of dimensions and last dimension, shaped either like ``x`` or
``[B, 1, ..., 1, K]`` with ``B`` 1 or ``x.shape[0]`` (the ``[B, 1, 1, K]`` padding mask of
``[B, H, Q, K]`` scores); and/or ``causal=True``, which masks the upper triangle of the last
two dimensions (column k > query q, top-left aligned like torch's SDPA ``is_causal``).
Rows whose every logit is masked give zeros, not NaN (torch.softmax gives NaN), and zero
gradient. Inputs must be finite.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from deepshard.kernels import loader
from deepshard.kernels.bench import BenchCase

SOURCE = "softmax.cu"
NAME_EXPRESSIONS = tuple(f"scaled_masked_softmax_{d}<{t}>" for d in ("fwd", "bwd")
                         for t in loader.CUDA_TYPES.values())


def mask_group(x: torch.Tensor, mask: torch.Tensor | None) -> int:
    """How many consecutive rows of ``x`` share one mask row; raises on an unsupported mask."""
    if mask is None:
        return 1
    if not mask.is_floating_point():
        raise TypeError(f"the mask is additive (0 / -inf) and floating point, not {mask.dtype}")
    if mask.shape == x.shape:
        return 1
    if (x.ndim >= 2 and mask.ndim == x.ndim and mask.shape[-1] == x.shape[-1]
            and mask.shape[0] in (1, x.shape[0]) and all(d == 1 for d in mask.shape[1:-1])):
        rows = x.numel() // x.shape[-1]
        return max(1, rows // mask.shape[0])
    raise ValueError(f"unsupported mask shape {tuple(mask.shape)} for scores "
                     f"{tuple(x.shape)}: use the scores' shape or [B or 1, 1, ..., 1, K]")


def _causal_rows(x: torch.Tensor, causal: bool) -> int:
    if not causal:
        return 0
    if x.ndim < 2:
        raise ValueError("causal softmax needs scores with at least 2 dimensions [..., Q, K]")
    return x.shape[-2]


def scaled_masked_softmax_reference(x: torch.Tensor, mask: torch.Tensor | None = None,
                                    scale: float = 1.0, causal: bool = False) -> torch.Tensor:
    """``softmax(scale * x + mask)`` in fp32, fully masked rows as zeros, in x's dtype."""
    mask_group(x, mask)
    z = x.float() * scale
    if mask is not None:
        z = z + mask.float()
    if _causal_rows(x, causal):
        q, k = x.shape[-2:]
        upper = torch.ones(q, k, dtype=torch.bool, device=x.device).triu(1)
        z = z.masked_fill(upper, -math.inf)
    top = z.amax(-1, keepdim=True)
    top = torch.where(top == -math.inf, 0.0, top)  # fully masked row: exp(-inf) = 0 below
    e = torch.exp(z - top)
    total = e.sum(-1, keepdim=True)
    return (e / torch.where(total == 0, 1.0, total)).to(x.dtype)


def scaled_masked_softmax_backward_reference(dy: torch.Tensor, y: torch.Tensor,
                                             scale: float = 1.0) -> torch.Tensor:
    """``dx = scale * y * (dy - sum(dy * y))`` in fp32, in y's dtype."""
    dyf, yf = dy.float(), y.float()
    return (scale * yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype)


def _threads(cols: int) -> int:
    return min(1024, max(32, (cols + 8 * 32 - 1) // (8 * 32) * 32))


def _fn(x: torch.Tensor, direction: str):
    name = f"scaled_masked_softmax_{direction}<{loader.CUDA_TYPES[x.dtype]}>"
    return loader.kernel(SOURCE, name, x.device, name_expressions=NAME_EXPRESSIONS)


def _check(x: torch.Tensor) -> None:
    if x.dtype not in loader.CUDA_TYPES:
        raise TypeError(f"softmax kernels take float32/float16/bfloat16, not {x.dtype}")
    if x.ndim == 0 or not 0 < x.shape[-1] < 2**31 or x.numel() // x.shape[-1] >= 2**31:
        raise ValueError(f"softmax needs 1 <= columns and rows < 2**31, got {tuple(x.shape)}")


def scaled_masked_softmax_forward(x: torch.Tensor, mask: torch.Tensor | None = None,
                                  scale: float = 1.0, causal: bool = False) -> torch.Tensor:
    """As :func:`scaled_masked_softmax_reference`; the kernel when on a GPU."""
    tensors = (x,) if mask is None else (x, mask)
    if not loader.cuda_ready(*tensors):
        return scaled_masked_softmax_reference(x, mask, scale, causal)
    _check(x)
    group, causal_q = mask_group(x, mask), _causal_rows(x, causal)
    cols = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    rows = xc.numel() // cols
    # The converted mask must stay referenced until the launch is queued.
    mask_c = None if mask is None else mask.to(torch.float32).contiguous()  # as added: fp32
    mask_ptr = np.uint64(0) if mask_c is None else loader.ptr(mask_c)
    if rows:
        loader.launch(_fn(x, "fwd"), (rows,), (_threads(cols),),
                      (loader.ptr(xc), mask_ptr, loader.ptr(y), np.int32(cols),
                       np.int32(group), np.int32(causal_q), np.float32(scale)))
    return y


def scaled_masked_softmax_backward(dy: torch.Tensor, y: torch.Tensor,
                                   scale: float = 1.0) -> torch.Tensor:
    """As :func:`scaled_masked_softmax_backward_reference`."""
    if not loader.cuda_ready(dy, y):
        return scaled_masked_softmax_backward_reference(dy, y, scale)
    _check(y)
    if dy.shape != y.shape or dy.dtype != y.dtype:
        raise ValueError("softmax backward needs dy with y's shape and dtype")
    cols = y.shape[-1]
    dyc, yc = dy.contiguous(), y.contiguous()
    dx = torch.empty_like(yc)
    rows = yc.numel() // cols
    if rows:
        loader.launch(_fn(y, "bwd"), (rows,), (_threads(cols),),
                      (loader.ptr(dyc), loader.ptr(yc), loader.ptr(dx), np.int32(cols),
                       np.float32(scale)))
    return dx


class ScaledMaskedSoftmaxFunction(torch.autograd.Function):
    """Autograd over the forward/backward pair; the mask gets no gradient."""

    @staticmethod
    def forward(ctx, x, mask, scale, causal):
        y = scaled_masked_softmax_forward(x, mask, scale, causal)
        ctx.scale = scale
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return scaled_masked_softmax_backward(dy, y, ctx.scale), None, None, None


def scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor | None = None,
                          scale: float = 1.0, causal: bool = False) -> torch.Tensor:
    """``softmax(scale * x + mask)`` over the last dimension (module docstring: layouts)."""
    mask_group(x, mask)
    _causal_rows(x, causal)
    return ScaledMaskedSoftmaxFunction.apply(x, mask, scale, causal)


def bench_cases(device: torch.device | str) -> list[BenchCase]:
    """Attention-score shapes with a padding mask and with the causal flag, against torch."""
    cases = []
    for dtype, shape, causal in ((torch.bfloat16, (4, 16, 1024, 4096), False),
                                 (torch.float16, (4, 16, 2048, 2048), True),
                                 (torch.float32, (2, 16, 512, 8192), False)):
        x = torch.randn(shape, device=device, dtype=dtype)
        dy = torch.randn_like(x)
        q, k = shape[-2:]
        mask = None if causal else torch.zeros(shape[0], 1, 1, k, device=device, dtype=dtype)
        if mask is not None:
            mask[..., k - k // 8:] = -math.inf  # the last eighth is padding
        upper = torch.ones(q, k, dtype=torch.bool, device=device).triu(1)
        scale = 1.0 / math.sqrt(128)
        y = scaled_masked_softmax_reference(x, mask, scale, causal)
        es = x.element_size()
        tag = f"{str(dtype).removeprefix('torch.')} {'x'.join(map(str, shape))}"
        tag += " causal" if causal else " padding mask"
        mask_bytes = 0 if mask is None else mask.numel() * es

        def theirs(x=x, mask=mask, scale=scale, causal=causal, upper=upper):
            z = x * scale
            z = z.masked_fill(upper, -math.inf) if causal else z + mask
            return torch.softmax(z, -1)

        cases.append(BenchCase(
            f"softmax fwd {tag}", 2 * x.numel() * es + mask_bytes,
            lambda x=x, mask=mask, scale=scale, causal=causal:
                scaled_masked_softmax_forward(x, mask, scale, causal),
            theirs, "torch.softmax(masked scale * x)"))
        cases.append(BenchCase(
            f"softmax bwd {tag}", 3 * x.numel() * es,
            lambda dy=dy, y=y, scale=scale: scaled_masked_softmax_backward(dy, y, scale),
            lambda dy=dy, y=y, scale=scale:
                torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype) * scale,
            "aten._softmax_backward_data * scale"))
    return cases
