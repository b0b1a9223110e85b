"""Fused multi-tensor LAMB (``cuda/lamb.cu``) with DeepSpeed ``FusedLamb``'s update, its
torch reference, and ``FusedLamb``, the optimizer the engine uses for ``LAMB`` on GPUs.

The formulas are those of :class:`deepshard.runtime.optim.lamb.Lamb` (the tests hold the
reference to it); this module re-states them because ``kernels`` imports nothing of the
runtime. The bias correction scales the step size, not the moments, so the trust ratio is
measured on the uncorrected update ``u = m / (sqrt(v) + eps) + wd p``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from . import loader
from .adam import CHUNK, MAX_BLOCKS, THREADS, _check, moment_columns, tensor_table
from .bench import BenchCase

_CLIP_EPS = 1e-6  # added to the gradient norm before comparing it with max_grad_norm


def step_size(lr: float, beta1: float, beta2: float, step: int, bias_correction: bool) -> float:
    """``lr * sqrt(1 - beta2^step) / (1 - beta1^step)``, or ``lr`` without bias correction."""
    if not bias_correction:
        return lr
    return lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def lamb_reference(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                   step: int, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, bias_correction: bool = True,
                   eps_inside_sqrt: bool = False, max_coeff: float = 10.0,
                   min_coeff: float = 0.01, grad_divisor: float | torch.Tensor = 1.0) -> None:
    """One LAMB step in place, in fp32 (the CPU path and the test oracle).

    Per tensor: ``g /= grad_divisor``; ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g²``;
    ``u = m / (sqrt(v) + eps) + wd p``; ``r = clamp(||p|| / ||u||, min_coeff, max_coeff)``
    (1 when a norm is 0); ``p -= step_size(lr, b1, b2, step, bias_correction) * r * u``.
    """
    size = step_size(lr, beta1, beta2, step, bias_correction)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        work = p.float()  # p itself when p is fp32
        g32 = g.float() / grad_divisor
        m.mul_(beta1).add_(g32, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        denom = v.add(eps).sqrt_() if eps_inside_sqrt else v.sqrt().add_(eps)
        u = (m / denom).add_(work, alpha=weight_decay)
        w_norm, u_norm = work.norm(), u.norm()
        ratio = (w_norm / u_norm).clamp(min_coeff, max_coeff)
        ratio = torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))
        work.sub_(u * (size * ratio))
        if work is not p:
            p.copy_(work)


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
    kw = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
              bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
              max_coeff=max_coeff, min_coeff=min_coeff, grad_divisor=grad_divisor)
    if not loader.cuda_ready(*params, *grads, *exp_avgs, *exp_avg_sqs):
        lamb_reference(params, grads, exp_avgs, exp_avg_sqs, **kw)
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


class FusedLamb(torch.optim.Optimizer):
    """DeepSpeed's ``FusedLamb``: the update of :func:`lamb_reference`, per param group.

    Arguments and state (``step`` int, fp32 ``exp_avg`` and ``exp_avg_sq``) are those of
    :class:`deepshard.runtime.optim.lamb.Lamb`, so checkpoints move between the two. With
    ``max_grad_norm > 0`` each group's gradients are clipped to it as one vector; the
    divisor stays on the device. One launch sequence per (device, dtype, step) bucket.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("LAMB does not support amsgrad")
        if min(lr, eps, weight_decay, max_grad_norm) < 0:
            raise ValueError("lr, eps, weight_decay and max_grad_norm must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {tuple(betas)}")
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply one LAMB update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("LAMB does not support sparse gradients")
            divisor = _clip_divisor([p.grad for p in params], group["max_grad_norm"])
            beta1, beta2 = group["betas"]
            for (device, _, step), (ps, gs, ms, vs) in moment_columns(self.state,
                                                                      params).items():
                fused_lamb_step(ps, gs, ms, vs, step=step, lr=group["lr"], beta1=beta1,
                                beta2=beta2, eps=group["eps"],
                                weight_decay=group["weight_decay"],
                                bias_correction=group["bias_correction"],
                                eps_inside_sqrt=group["eps_inside_sqrt"],
                                max_coeff=group["max_coeff"], min_coeff=group["min_coeff"],
                                grad_divisor=divisor.to(device))
        return loss


def _clip_divisor(grads: list[torch.Tensor], max_grad_norm: float) -> torch.Tensor:
    """``max(1, (||G|| + 1e-6) / max_grad_norm)`` over all ``grads`` as one vector, as a
    0-dim fp32 tensor on the first gradient's device (1 when clipping is off); no sync."""
    device = grads[0].device
    if max_grad_norm <= 0:
        return torch.ones((), dtype=torch.float32, device=device)
    squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).square().to(device)
                           for g in grads]).sum()
    clip = (squares.sqrt() + _CLIP_EPS) / max_grad_norm
    return clip.clamp_min(1.0)


def bench_cases(device: torch.device) -> list[BenchCase]:
    """64M fp32 parameters in 20 tensors: ours against deepshard's ``torch._foreach`` Lamb
    (torch has no LAMB), on the same kind of GPU tensors."""
    # Benchmark-only import from the runtime (kernels is otherwise a leaf): the peer is the
    # optimizer the engine would use without this kernel.
    from deepshard.runtime.optim.lamb import Lamb

    sizes = [(64 << 20) // 20] * 19
    sizes.append((64 << 20) - sum(sizes))
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen) for s in sizes]
    grads = [torch.randn(s, device=device, generator=gen) for s in sizes]
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    steps = iter(range(1, 1 << 30))

    def ours() -> None:
        fused_lamb_step(params, grads, ms, vs, step=next(steps), lr=1e-3, beta1=0.9,
                        beta2=0.999, eps=1e-8, weight_decay=0.01)

    peer_params = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(peer_params, grads, strict=True):
        p.grad = g
    peer = Lamb(peer_params, lr=1e-3, weight_decay=0.01)
    # The op's minimum: params read+write, grads read, two fp32 moments read+write (the
    # second read of p and the fp32 scratch u are this implementation's extra traffic).
    bytes_moved = sum(sizes) * 4 * (2 + 1 + 4)
    return [BenchCase("fused_lamb 64M fp32 x20", bytes_moved, ours, peer.step,
                      "deepshard Lamb (torch._foreach)")]
