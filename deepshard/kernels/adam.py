"""Fused multi-tensor Adam/AdamW (``cuda/adam.cu``) and its torch reference.

The engine keeps torch's own fused AdamW by default (see ``runtime/optim/build.py``); this
kernel is benchmarked against it. The optimizer around it is
:class:`deepshard.runtime.optim.adam.KernelAdam`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import torch

from deepshard.kernels import loader
from deepshard.kernels.bench import BenchCase

CHUNK = 1 << 16
"""Elements per chunk: one block updates one chunk of one tensor at a time."""
THREADS = 512
MAX_BLOCKS = 1 << 16
"""Grid cap; the kernels grid-stride over chunks beyond it."""
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=64)
def _table_cached(device: torch.device, pointers: tuple[int, ...], sizes: tuple[int, ...],
                  chunk: int) -> tuple[torch.Tensor, int]:
    chunks = [math.ceil(s / chunk) for s in sizes]
    prefix = [0]
    for c in chunks:
        prefix.append(prefix[-1] + c)
    host = torch.tensor([*pointers, *sizes, *prefix], dtype=torch.int64)
    return host.to(device), prefix[-1]


def tensor_table(columns: Sequence[Sequence[torch.Tensor]], chunk: int = CHUNK
                 ) -> tuple[torch.Tensor, int]:
    """The kernels' int64 device table (pointer columns, sizes, chunk prefix) and chunk count.

    Cached on the pointers and sizes themselves: the table is a pure function of them, so a
    hit is correct even if the memory was freed and reallocated in between, and an
    optimizer with fixed tensors copies its table to the GPU once instead of every step.
    """
    first = columns[0]
    pointers = tuple(t.data_ptr() for col in columns for t in col)
    sizes = tuple(t.numel() for t in first)
    return _table_cached(first[0].device, pointers, sizes, chunk)


def _check(tensors: Iterable[torch.Tensor], dtype: torch.dtype, what: str) -> None:
    for t in tensors:
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous {dtype}, got {t.dtype} "
                             f"(contiguous={t.is_contiguous()})")


def _bias_corrections(beta1: float, beta2: float, step: int, on: bool) -> tuple[float, float]:
    if not on:
        return 1.0, 1.0
    return 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)


def adam_reference(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                   step: int, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, decoupled: bool, bias_correction: bool = True) -> None:
    """One Adam step in place, in fp32, from the formulas (the CPU path and the test oracle).

    ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g²``,
    ``p -= lr / (1-b1^t) * m / (sqrt(v) / sqrt(1-b2^t) + eps)``; weight decay is decoupled
    (``p *= 1 - lr wd`` first, AdamW) or L2 (``g += wd p``, Adam). Moments are fp32.
    """
    bc1, bc2_sqrt = _bias_corrections(beta1, beta2, step, bias_correction)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        work = p.float()  # p itself when p is fp32
        g32 = g.float()
        if weight_decay and not decoupled:
            g32 = g32 + weight_decay * work
        m.mul_(beta1).add_(g32, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        if weight_decay and decoupled:
            work.mul_(1 - lr * weight_decay)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        work.addcdiv_(m, denom, value=-lr / bc1)
        if work is not p:
            p.copy_(work)


def fused_adam_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                    step: int, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, decoupled: bool, bias_correction: bool = True) -> None:
    """One Adam step in place over same-dtype tensors: the CUDA kernel when every tensor is
    on a GPU and CuPy is installed, else :func:`adam_reference`.

    Params and grads share one dtype (fp32, fp16 or bf16); the moments are contiguous fp32.
    """
    if not params:
        return
    if not loader.cuda_ready(*params, *grads, *exp_avgs, *exp_avg_sqs):
        adam_reference(params, grads, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=beta1,
                       beta2=beta2, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
                       bias_correction=bias_correction)
        return
    import numpy as np

    dtype = params[0].dtype
    _check([*params, *grads], dtype, "params and grads")
    _check([*exp_avgs, *exp_avg_sqs], torch.float32, "exp_avg and exp_avg_sq")
    table, chunks = tensor_table([params, grads, exp_avgs, exp_avg_sqs])
    if chunks == 0:  # only empty tensors
        return
    fn = loader.kernel("adam.cu", f"adam_step<{loader.CUDA_TYPES[dtype]}>", params[0].device,
                       name_expressions=[f"adam_step<{t}>" for t in loader.CUDA_TYPES.values()])
    bc1, bc2_sqrt = _bias_corrections(beta1, beta2, step, bias_correction)
    f = np.float32
    args = (loader.ptr(table), np.int32(len(params)), np.int64(CHUNK), f(lr), f(beta1),
            f(beta2), f(eps), f(weight_decay), f(bc1), f(bc2_sqrt), np.int32(decoupled))
    loader.launch(fn, (min(chunks, MAX_BLOCKS),), (THREADS,), args)


def bench_cases(device: torch.device) -> list[BenchCase]:
    """64M fp32 parameters in 20 tensors: ours against ``torch.optim.AdamW(fused=True)``."""
    sizes = [(64 << 20) // 20] * 19
    sizes.append((64 << 20) - sum(sizes))
    gen = torch.Generator(device=device).manual_seed(0)

    def tensors() -> list[torch.Tensor]:
        return [torch.randn(s, device=device, generator=gen) for s in sizes]

    params, grads = tensors(), tensors()
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    steps = iter(range(1, 1 << 30))

    def ours() -> None:
        fused_adam_step(params, grads, ms, vs, step=next(steps), lr=1e-3, beta1=0.9,
                        beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)

    peer_params = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(peer_params, grads, strict=True):
        p.grad = g
    peer = torch.optim.AdamW(peer_params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                             weight_decay=0.01, fused=True)
    # params read+write, grads read, two fp32 moments read+write: 28 bytes per fp32 param.
    bytes_moved = sum(sizes) * 4 * (2 + 1 + 4)
    return [BenchCase("fused_adam 64M fp32 x20", bytes_moved, ours, peer.step,
                      "torch.optim.AdamW(fused=True)")]
