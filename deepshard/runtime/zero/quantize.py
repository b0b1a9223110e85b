"""Block-wise symmetric quantization for ZeRO++'s compressed collectives, in plain torch.

A 1-D tensor is cut into blocks of ``block`` elements (the last one zero-padded); each block
gets one fp32 scale, ``max|x| / qmax``, and its elements ``round(x / scale)`` in
``[-qmax, qmax]``: int8 (``bits=8``, qmax 127) or int4 (``bits=4``, qmax 7, two values per
byte). The error of every element is at most half a step: ``|x - x'| <= scale / 2 =
max|block| / (2 qmax)``, i.e. 1/254 of its block's largest magnitude at int8 and 1/14 at
int4; a block of zeros stays exact. :func:`pack` puts the values and the scales in one
``uint8`` tensor, so that one collective carries both.
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7}


def packed_bytes(numel: int, block: int, bits: int = 8) -> int:
    """Bytes of :func:`pack`'s output for ``numel`` elements."""
    blocks = -(-numel // block)
    return blocks * block * bits // 8 + 4 * blocks


def quantize(x: torch.Tensor, block: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``: int8 values (``blocks x block``, in ``[-qmax, qmax]``) and one
    fp32 scale per block."""
    qmax = QMAX[bits]
    flat = x.detach().reshape(-1).float()
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    rows = flat.view(-1, block)
    scales = rows.abs().amax(dim=1) / qmax
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(rows / scales[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, numel: int,
               out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """The ``numel`` values ``values * scale`` (into ``out`` when given)."""
    rows = values.float() * scales[:, None]
    flat = rows.reshape(-1)[:numel]
    if out is None:
        return flat.to(dtype)
    out.copy_(flat)
    return out


def pack(values: torch.Tensor, scales: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Values then scales as one ``uint8`` tensor (int4: two values per byte)."""
    v = values.reshape(-1)
    if bits == 4:
        u = (v + 8).to(torch.uint8)  # [1, 15]
        v = (u[0::2] | (u[1::2] << 4)).view(torch.int8)
    return torch.cat([v.view(torch.uint8), scales.contiguous().view(torch.uint8)])


def unpack(buf: torch.Tensor, numel: int, block: int, bits: int = 8
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack`'s inverse for a tensor of ``numel`` elements."""
    blocks = -(-numel // block)
    n = blocks * block
    nbytes = n * bits // 8
    raw = buf[:nbytes]
    if bits == 4:
        lo = (raw & 0x0F).to(torch.int16) - 8
        hi = (raw >> 4).to(torch.int16) - 8
        values = torch.stack([lo, hi], dim=1).reshape(-1).to(torch.int8)
    else:
        values = raw.view(torch.int8)
    scales = buf[nbytes:nbytes + 4 * blocks].clone().view(torch.float32)
    return values.view(blocks, block), scales


def roundtrip(x: torch.Tensor, block: int, bits: int = 8) -> torch.Tensor:
    """``x`` through quantize, pack, unpack and dequantize (what the far side sees)."""
    values, scales = quantize(x, block, bits)
    v, s = unpack(pack(values, scales, bits), x.numel(), block, bits)
    return dequantize(v, s, x.numel(), dtype=x.dtype).view_as(x)
