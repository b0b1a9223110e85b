"""1-bit sign compression for compressed communication (``cuda/onebit.cu``), as DeepSpeed's
1-bit Adam/LAMB use it, with its torch references.

``pack(x) -> (bits, scale, numel)``: ``bits`` is uint8 of ``ceil(numel / 8)`` bytes, element i
being bit ``i % 8`` of byte ``i // 8``, least significant bit first (numpy's
``packbits(bitorder="little")``); a 1 bit means ``x >= 0`` (so -0.0 packs as 1, NaN as 0);
padding bits of the last byte are 0. ``scale`` is a 0-d fp32 tensor, ``mean(|x|)`` over the
whole tensor (the scale minimising ``||x - scale * sign(x)||``; DeepSpeed's compressed
allreduce uses the RMS instead). ``unpack(bits, scale, numel, dtype)`` gives the flat tensor
of ``+-scale``. Error feedback (keeping ``x - unpack(pack(x))`` for the next step) is left to
callers. There is no autograd Function: a compressor sits outside the autograd graph.
"""

from __future__ import annotations

import numpy as np
import torch

from . import loader
from .bench import BenchCase

SOURCE = "onebit.cu"
NAME_EXPRESSIONS = ("onebit_scale", *(f"onebit_{d}<{t}>" for d in ("pack", "unpack")
                                      for t in loader.CUDA_TYPES.values()))
_THREADS = 256
_MAX_PARTS = 2048
"""Blocks of the pack kernel (each writes one partial sum of |x|)."""


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=device)


def pack_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(bits, scale, numel)`` in plain torch (module docstring: layout)."""
    flat = x.reshape(-1)
    n = flat.numel()
    nbytes = (n + 7) // 8
    signs = torch.zeros(nbytes * 8, dtype=torch.uint8, device=x.device)
    signs[:n] = flat >= 0
    bits = (signs.view(nbytes, 8) * _bit_weights(x.device)).sum(-1, dtype=torch.uint8)
    scale = flat.float().abs().mean() if n else torch.zeros((), device=x.device)
    return bits, scale, n


def unpack_reference(bits: torch.Tensor, scale: torch.Tensor, numel: int,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat ``numel`` tensor of ``+scale`` (bit 1) and ``-scale`` (bit 0), in ``dtype``."""
    _check_bits(bits, numel)
    signs = (bits[:, None] & _bit_weights(bits.device)) != 0
    s = scale.float()
    return torch.where(signs.reshape(-1)[:numel], s, -s).to(dtype)


def _check_bits(bits: torch.Tensor, numel: int) -> None:
    if bits.dtype != torch.uint8 or bits.ndim != 1 or bits.numel() != (numel + 7) // 8:
        raise ValueError(f"bits must be uint8 of shape ({(numel + 7) // 8},) for {numel} "
                         f"elements, got {bits.dtype} {tuple(bits.shape)}")


def _fn(name: str, device: torch.device):
    return loader.kernel(SOURCE, name, device, name_expressions=NAME_EXPRESSIONS)


def pack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Signs and scale of ``x`` as :func:`pack_reference`; the kernels when on a GPU."""
    n = x.numel()
    if not loader.cuda_ready(x) or n == 0:
        return pack_reference(x)
    if x.dtype not in loader.CUDA_TYPES:
        raise TypeError(f"onebit kernels take float32/float16/bfloat16, not {x.dtype}")
    xc = x.contiguous()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    parts = min((n + _THREADS - 1) // _THREADS, _MAX_PARTS)
    partial = torch.empty(parts, dtype=torch.float32, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    loader.launch(_fn(f"onebit_pack<{loader.CUDA_TYPES[x.dtype]}>", x.device), (parts,),
                  (_THREADS,), (loader.ptr(xc), loader.ptr(bits), loader.ptr(partial),
                                np.uint64(n)))
    loader.launch(_fn("onebit_scale", x.device), (1,), (1024,),
                  (loader.ptr(partial), np.int32(parts), loader.ptr(scale), np.uint64(n)))
    return bits, scale, n


def unpack(bits: torch.Tensor, scale: torch.Tensor, numel: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``+-scale`` per packed sign, as :func:`unpack_reference`; the kernel when on a GPU."""
    if not loader.cuda_ready(bits, scale) or numel == 0:
        return unpack_reference(bits, scale, numel, dtype)
    _check_bits(bits, numel)
    if dtype not in loader.CUDA_TYPES:
        raise TypeError(f"onebit kernels unpack to float32/float16/bfloat16, not {dtype}")
    y = torch.empty(numel, dtype=dtype, device=bits.device)
    scale32 = scale.to(torch.float32).contiguous()
    blocks = min((numel + _THREADS - 1) // _THREADS, 1 << 20)
    loader.launch(_fn(f"onebit_unpack<{loader.CUDA_TYPES[dtype]}>", bits.device), (blocks,),
                  (_THREADS,), (loader.ptr(bits.contiguous()), loader.ptr(scale32),
                                loader.ptr(y), np.uint64(numel)))
    return y


def bench_cases(device: torch.device | str) -> list[BenchCase]:
    """Packing and unpacking a 256M-element gradient buffer, against the torch reference."""
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        n = 1 << 28
        x = torch.randn(n, device=device, dtype=dtype)
        bits, scale, _ = pack_reference(x)
        es, tag = x.element_size(), f"{str(dtype).removeprefix('torch.')} {n}"
        cases.append(BenchCase(f"onebit pack {tag}", n * es + n // 8 + 4,
                               lambda x=x: pack(x), lambda x=x: pack_reference(x),
                               "torch (x >= 0, bit weights, sum) + abs().mean()"))
        cases.append(BenchCase(f"onebit unpack {tag}", n // 8 + 4 + n * es,
                               lambda b=bits, s=scale, d=dtype, n=n: unpack(b, s, n, d),
                               lambda b=bits, s=scale, d=dtype, n=n: unpack_reference(b, s, n, d),
                               "torch (bit test, where)"))
    return cases
