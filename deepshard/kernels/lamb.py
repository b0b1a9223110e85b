"""LAMB with DeepSpeed ``FusedLamb``'s update: the one torch oracle of its math and the fused
multi-tensor CUDA kernel (``cuda/lamb.cu``).

:func:`lamb_reference`, :func:`clip_divisor`, :func:`device_clip_divisor`, :func:`step_size`
and :func:`check_hyperparameters` are the only statement of the formulas in torch: the
runtime's :class:`deepshard.runtime.optim.lamb.Lamb` (every device) is built on them,
:class:`deepshard.runtime.optim.lamb.KernelLamb` (what the engine uses for ``LAMB`` on GPUs)
runs :func:`fused_lamb_step` and falls back to :func:`lamb_reference` where the kernel cannot
run, and the kernel's tests hold it to :func:`lamb_reference`. They live here because
``kernels`` imports nothing of the runtime. The bias correction scales the step size, not the
moments, so the trust ratio is measured on the uncorrected update
``u = m / (sqrt(v) + eps) + wd p``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from deepshard.kernels import loader
from deepshard.kernels.adam import CHUNK, MAX_BLOCKS, THREADS, _check, tensor_table
from deepshard.kernels.bench import BenchCase

CLIP_EPS = 1e-6  # added to the gradient norm before comparing it with max_grad_norm
LOW_PRECISION = (torch.float16, torch.bfloat16)  # updated in fp32, with fp32 moments


def check_hyperparameters(lr: float, bias_correction: bool, betas: tuple[float, float],
                          eps: float, eps_inside_sqrt: bool, weight_decay: float,
                          max_grad_norm: float, max_coeff: float, min_coeff: float,
                          amsgrad: bool) -> dict[str, Any]:
    """The optimizer defaults of a LAMB with these arguments; ``ValueError`` for a bad one."""
    if amsgrad:
        raise ValueError("LAMB does not support amsgrad")
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if max_grad_norm < 0:
        raise ValueError(f"max_grad_norm must be >= 0 (0 disables clipping), got {max_grad_norm}")
    if not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"betas must be in [0, 1), got {tuple(betas)}")
    if not 0 <= min_coeff <= max_coeff:
        raise ValueError(f"need 0 <= min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
    return dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff)


def step_size(lr: float, beta1: float, beta2: float, step: int, bias_correction: bool) -> float:
    """``lr * sqrt(1 - beta2^step) / (1 - beta1^step)``, or ``lr`` without bias correction."""
    if not bias_correction:
        return lr
    return lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def clip_divisor(grads: Sequence[torch.Tensor], max_grad_norm: float) -> float:
    """What to divide ``grads`` by so their norm, as one vector, is at most ``max_grad_norm``:
    ``max(1, (||G|| + 1e-6) / max_grad_norm)``, 1 when clipping is off (``max_grad_norm``
    0). fp16/bf16 norms are taken in fp32; the sum and the square root in Python floats."""
    if max_grad_norm <= 0:
        return 1.0
    squares = 0.0
    for bucket in by_device_and_dtype(grads):
        dtype = torch.float32 if bucket[0].dtype in LOW_PRECISION else None
        squares += float(torch.stack(torch._foreach_norm(bucket, 2, dtype=dtype)).square().sum())
    clip = (math.sqrt(squares) + CLIP_EPS) / max_grad_norm
    return clip if clip > 1 else 1.0


def lamb_reference(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                   step: int | Sequence[int], lr: float, beta1: float, beta2: float,
                   eps: float, weight_decay: float, bias_correction: bool = True,
                   eps_inside_sqrt: bool = False, max_coeff: float = 10.0,
                   min_coeff: float = 0.01, grad_divisor: float | torch.Tensor = 1.0) -> None:
    """One LAMB step in place, with ``torch._foreach`` ops: the oracle of every LAMB here.

    Per tensor: ``g /= grad_divisor``; ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g²``;
    ``u = m / (sqrt(v) + eps) + wd p`` (``sqrt(v + eps)`` with ``eps_inside_sqrt``);
    ``r = clamp(||p|| / ||u||, min_coeff, max_coeff)`` (1 when a norm is 0);
    ``p -= step_size(lr, b1, b2, step, bias_correction) * r * u``. ``step`` is one count
    for all tensors or one per tensor. The tensors share a device and a dtype; fp16/bf16
    params are computed in fp32 (their moments must be fp32), others in their own dtype,
    with moments of that dtype. ``grads`` are read, never written.
    """
    if not params:
        return
    divisor = float(grad_divisor)
    steps = [step] * len(params) if isinstance(step, int) else list(step)
    low_precision = params[0].dtype in LOW_PRECISION
    work = [p.float() for p in params] if low_precision else list(params)
    g = [t.to(work[0].dtype) for t in grads]

    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, g, alpha=(1 - beta1) / divisor)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=(1 - beta2) / divisor**2)
    del g

    if eps_inside_sqrt:
        denom = torch._foreach_add(exp_avg_sqs, eps)
        torch._foreach_sqrt_(denom)
    else:
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denom, eps)
    update = torch._foreach_div(exp_avgs, denom)
    del denom
    if weight_decay != 0:
        torch._foreach_add_(update, work, alpha=weight_decay)

    w_norm = torch.stack(torch._foreach_norm(work))
    u_norm = torch.stack(torch._foreach_norm(update))
    ratio = (w_norm / u_norm).clamp_max(max_coeff).clamp_min(min_coeff)
    ratio = torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))
    sizes = torch.tensor([step_size(lr, beta1, beta2, t, bias_correction) for t in steps],
                         dtype=ratio.dtype, device=ratio.device)
    torch._foreach_mul_(update, (ratio * sizes).neg().unbind(0))
    torch._foreach_add_(work, update)
    if low_precision:
        torch._foreach_copy_(params, work)


def by_device_and_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by (device, dtype), in first-seen order: what one foreach call takes."""
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(buckets.values())


def fused_lamb_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                    step: int, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, bias_correction: bool = True,
                    eps_inside_sqrt: bool = False, max_coeff: float = 10.0,
                    min_coeff: float = 0.01, grad_divisor: float | torch.Tensor = 1.0) -> None:
    """:func:`lamb_reference`'s step on the GPU when every tensor is on one and CuPy is
    installed. Params and grads share one dtype (fp32, fp16, bf16); moments are contiguous
    fp32. ``grad_divisor`` may be a one-element device tensor (clipping without a sync)."""
    if not params:
        return
    if not loader.cuda_ready(*params, *grads, *exp_avgs, *exp_avg_sqs):
        lamb_reference(params, grads, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=beta1,
                       beta2=beta2, eps=eps, weight_decay=weight_decay,
                       bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                       max_coeff=max_coeff, min_coeff=min_coeff, grad_divisor=grad_divisor)
        return
    import numpy as np

    dtype, device = params[0].dtype, params[0].device
    _check([*params, *grads], dtype, "params and grads")
    _check([*exp_avgs, *exp_avg_sqs], torch.float32, "exp_avg and exp_avg_sq")
    scratch = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=device)
    us = list(scratch.split([p.numel() for p in params]))
    table, chunks = tensor_table([params, grads, exp_avgs, exp_avg_sqs, us])
    if chunks == 0:  # only empty tensors: nothing to update
        return
    partials = torch.empty(2 * chunks, dtype=torch.float32, device=device)
    ratio = torch.empty(len(params), dtype=torch.float32, device=device)
    divisor = torch.as_tensor(grad_divisor, dtype=torch.float32, device=device).reshape(1)
    ctype = loader.CUDA_TYPES[dtype]
    names = ["lamb_ratio", *(f"lamb_{k}<{t}>" for k in ("update", "apply")
                             for t in loader.CUDA_TYPES.values())]

    def fn(name: str) -> Any:
        return loader.kernel("lamb.cu", name, device, name_expressions=names)

    f, n, grid = np.float32, np.int32(len(params)), (min(chunks, MAX_BLOCKS),)
    loader.launch(fn(f"lamb_update<{ctype}>"), grid, (THREADS,),
                  (loader.ptr(table), n, np.int64(CHUNK), loader.ptr(partials),
                   loader.ptr(divisor), f(beta1), f(beta2), f(eps), f(weight_decay),
                   np.int32(eps_inside_sqrt)))
    loader.launch(fn("lamb_ratio"), (len(params),), (256,),
                  (loader.ptr(table), n, loader.ptr(partials), loader.ptr(ratio),
                   f(min_coeff), f(max_coeff)))
    loader.launch(fn(f"lamb_apply<{ctype}>"), grid, (THREADS,),
                  (loader.ptr(table), n, np.int64(CHUNK), loader.ptr(ratio),
                   f(step_size(lr, beta1, beta2, step, bias_correction))))


def device_clip_divisor(grads: Sequence[torch.Tensor], max_grad_norm: float) -> torch.Tensor:
    """:func:`clip_divisor` kept on the device: a 0-dim fp32 tensor on the first gradient's
    device (1 when clipping is off), with no host sync; the sum and root are fp32."""
    device = grads[0].device
    if max_grad_norm <= 0:
        return torch.ones((), dtype=torch.float32, device=device)
    squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).square().to(device)
                           for g in grads]).sum()
    clip = (squares.sqrt() + CLIP_EPS) / max_grad_norm
    return clip.clamp_min(1.0)


def bench_cases(device: torch.device) -> list[BenchCase]:
    """64M fp32 parameters in 20 tensors: ours against :func:`lamb_reference` (torch has no
    LAMB), the ``torch._foreach`` update the runtime's ``Lamb`` runs without this kernel, on
    the same kind of GPU tensors."""
    sizes = [(64 << 20) // 20] * 19
    sizes.append((64 << 20) - sum(sizes))
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen) for s in sizes]
    grads = [torch.randn(s, device=device, generator=gen) for s in sizes]
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    def stepper(step_fn: Callable[..., None], tensors: list[torch.Tensor]) -> Callable[[], None]:
        ms = [torch.zeros_like(p) for p in tensors]
        vs = [torch.zeros_like(p) for p in tensors]
        steps = iter(range(1, 1 << 30))
        return lambda: step_fn(tensors, grads, ms, vs, step=next(steps), **hp)

    ours = stepper(fused_lamb_step, params)
    peer = stepper(lamb_reference, [p.clone() for p in params])
    # The op's minimum: params read+write, grads read, two fp32 moments read+write (the
    # second read of p and the fp32 scratch u are this implementation's extra traffic).
    bytes_moved = sum(sizes) * 4 * (2 + 1 + 4)
    return [BenchCase("fused_lamb 64M fp32 x20", bytes_moved, ours, peer,
                      "lamb_reference (torch._foreach, the runtime Lamb's update)")]
