"""The compressed all-reduce with error feedback that 1-bit Adam, 0/1 Adam and 1-bit LAMB use.

Two phases over a process group of ``world`` ranks, on a flat fp32 buffer padded to a
multiple of ``8 * world`` (so each of the ``world`` chunks packs to whole bytes):

1. worker: ``x = buffer + worker_error``; chunk ``r`` of ``x`` (the one rank ``r`` serves) is
   compressed to its signs and ONE scale, the chunk's RMS (``norm / sqrt(numel)``, as
   DeepSpeed's); ``worker_error = x - decompress(compress(x))``. An all-to-all hands every
   rank its chunk of everyone's signs and scales.
2. server: each rank averages the decompressed chunks it received, adds its
   ``server_error``, re-compresses the result (one scale), keeps
   ``server_error = y - decompress(compress(y))``, and an all-gather returns everyone the
   whole compressed result, decompressed into ``buffer``.

A sign packs as one bit, eight to a byte, least significant bit first, 1 meaning ``x >= 0``
(the layout of :mod:`deepshard.kernels.onebit`, whose CUDA kernel packs the bits on a GPU).
Each phase is ONE collective of uint8 rows ``[signs | scale as 4 bytes]``, through
:mod:`deepshard.comm` so that its comms logger counts the bytes; what a rank sends to the
others is then ``2 (world - 1) / world * numel / 8`` bytes plus ``8 (world - 1)`` of scales,
1/32 of a ring all-reduce of the fp32 buffer plus the scales.

:meth:`CompressedAllreduce.simulate` runs the same arithmetic on a list of per-rank buffers in
one process, with the same functions, so that a multi-rank run matches it bit for bit.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch

from deepshard.comm.collectives import all_gather_into_tensor, all_to_all_single
from deepshard.comm.process_group import get_rank, get_world_size

_SCALE_BYTES = 4
_GATHER = 0x0102040810204080
"""Times eight 0/1 bytes read as one little-endian int64, puts byte ``i`` at bit ``56 + i``."""
_LITTLE = sys.byteorder == "little"
_TABLES: dict[torch.device, torch.Tensor] = {}


def _unpack_table(device: torch.device) -> torch.Tensor:
    """(256, 8) fp32: row ``b`` is the ``+-1`` of byte ``b``'s bits, least significant first."""
    table = _TABLES.get(device)
    if table is None:
        shifts = torch.arange(8, dtype=torch.uint8)
        ones = (torch.arange(256, dtype=torch.uint8)[:, None] >> shifts) & 1
        table = _TABLES[device] = ones.to(torch.float32).mul_(2.0).sub_(1.0).to(device)
    return table


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """The signs of the flat ``x`` (``numel`` a multiple of 8) as ``numel // 8`` uint8 bytes:
    element ``i`` is bit ``i % 8`` of byte ``i // 8``, 1 for ``x >= 0`` (-0.0 too), 0 else."""
    if x.numel() % 8:
        raise ValueError(f"pack_signs takes a multiple of 8 elements, got {x.numel()}")
    if x.is_cuda:  # the CuPy kernel when it can run (its own torch fallback otherwise)
        from deepshard.kernels import onebit

        return onebit.pack(x.reshape(-1))[0]
    signs = (x.reshape(-1) >= 0).view(torch.uint8)  # a fresh, aligned 0/1 byte per element
    if _LITTLE:  # eight bytes at once: one multiply and one shift per output byte
        return ((signs.view(torch.int64) * _GATHER) >> 56).to(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)
    return (signs.view(-1, 8) << shifts).sum(-1, dtype=torch.uint8)


def unpack_signs(bits: torch.Tensor) -> torch.Tensor:
    """``+1.0`` / ``-1.0`` (fp32) per bit of the uint8 ``bits``, as :func:`pack_signs` laid
    them out: ``8 * bits.numel()`` elements."""
    if bits.dtype != torch.uint8:
        raise ValueError(f"unpack_signs takes uint8 bits, got {bits.dtype}")
    flat = bits.reshape(-1)
    if flat.is_cuda:
        from deepshard.kernels import onebit

        one = torch.ones((), dtype=torch.float32, device=flat.device)
        return onebit.unpack(flat, one, flat.numel() * 8, torch.float32)
    return torch.index_select(_unpack_table(flat.device), 0, flat.to(torch.int32)).view(-1)


def compress_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of the 2-d fp32 ``x`` as ``(signs, scale)``: the uint8 rows
    ``[packed signs | the row's RMS as 4 bytes]`` and the fp32 scales (one per row)."""
    rows, cols = x.shape
    scales = torch.linalg.vector_norm(x, dim=1) / math.sqrt(cols)
    wire = torch.empty(rows, cols // 8 + _SCALE_BYTES, dtype=torch.uint8, device=x.device)
    wire[:, :cols // 8] = pack_signs(x).view(rows, cols // 8)
    wire[:, cols // 8:] = scales.to(torch.float32).reshape(rows, 1).view(torch.uint8)
    return wire, scales


def compression_error(x: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x - decompress_rows(compress_rows(x)[0])`` without unpacking the bits, in
    three passes and no allocation: ``+-scale`` with the sign of ``x + 0.0`` (which turns
    -0.0 into +0.0, packed as a 1 bit too; a NaN gives a NaN error either way), so the same
    values bit for bit. ``out`` must not be ``x``."""
    s = scales.to(torch.float32).reshape(-1, 1).expand_as(x)
    torch.add(x, 0.0, out=out)
    torch.copysign(s, out, out=out)
    torch.sub(x, out, out=out)


def decompress_rows(wire: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 rows ``+-scale`` that :func:`compress_rows`'s ``wire`` rows encode (into
    ``out``, a contiguous fp32 tensor of as many elements, when given)."""
    rows, width = wire.shape
    cols = (width - _SCALE_BYTES) * 8
    scales = wire[:, cols // 8:].clone(memory_format=torch.contiguous_format).view(
        torch.float32)  # (rows, 1), at offset 0 (a view of another dtype needs it aligned)
    bits = wire[:, :cols // 8].contiguous()
    if out is None or bits.is_cuda:
        signs = unpack_signs(bits)
        if out is not None:
            out.view(-1).copy_(signs)
            signs = out
    else:
        signs = torch.index_select(_unpack_table(bits.device), 0,
                                   bits.reshape(-1).to(torch.int32), out=out.view(-1, 8))
    return signs.view(rows, cols).mul_(scales)


def _worker_phase(buffer: torch.Tensor, worker_error: torch.Tensor,
                  world: int) -> torch.Tensor:
    """``buffer += worker_error``, compressed per chunk; ``worker_error`` becomes the
    compression error. Returns the wire rows, row ``r`` for rank ``r``."""
    x = buffer.add_(worker_error).view(world, -1)
    wire, scales = compress_rows(x)
    compression_error(x, scales, worker_error.view(world, -1))
    return wire


def _server_phase(received: torch.Tensor, server_error: torch.Tensor) -> torch.Tensor:
    """The average of the decompressed ``received`` rows plus ``server_error``, compressed
    to one wire row; ``server_error`` becomes its compression error."""
    world = received.shape[0]
    y = decompress_rows(received).div_(world).sum(0).add_(server_error).view(1, -1)
    wire, scales = compress_rows(y)
    compression_error(y, scales, server_error.view(1, -1))
    return wire


class CompressedAllreduce:
    """The two-phase 1-bit all-reduce with error feedback (module docstring) over ``group``.

    Args:
        group: the process group (the data-parallel group); ``None`` is the default group.

    Attributes:
        last_bytes_sent: bytes this rank sent to the other ranks in the last call (phase 1's
            rows for the others, plus its own row once for each other rank in phase 2).
        bytes_sent: the running total of ``last_bytes_sent``.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.world = get_world_size(group)
        self.rank = get_rank(group)
        self.last_bytes_sent = 0
        self.bytes_sent = 0

    def padded_numel(self, numel: int) -> int:
        """``numel`` rounded up to a multiple of ``8 * world`` (whole bytes per chunk)."""
        return padded_numel(numel, self.world)

    def new_errors(self, numel: int, device: torch.device | str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero ``(worker_error, server_error)`` for a buffer of ``numel`` elements:
        ``padded_numel(numel)`` and ``padded_numel(numel) // world`` fp32 elements."""
        padded = self.padded_numel(numel)
        return (torch.zeros(padded, dtype=torch.float32, device=device),
                torch.zeros(padded // self.world, dtype=torch.float32, device=device))

    def __call__(self, buffer: torch.Tensor, worker_error: torch.Tensor,
                 server_error: torch.Tensor) -> None:
        """All-reduce (average) the flat fp32 ``buffer`` of ``padded_numel`` elements in
        place, compressed, updating both error buffers in place. Every rank of the group
        must call it with buffers of the same size."""
        _check_buffers(buffer, worker_error, server_error, self.world)
        if buffer.numel() == 0:
            self.last_bytes_sent = 0
            return
        wire = _worker_phase(buffer, worker_error, self.world)
        received = torch.empty_like(wire)
        all_to_all_single(received, wire, group=self.group,
                          log_name="compressed_allreduce_all_to_all")
        server_wire = _server_phase(received, server_error)
        gathered = torch.empty_like(wire)
        all_gather_into_tensor(gathered.view(-1), server_wire.view(-1), group=self.group,
                               log_name="compressed_allreduce_all_gather")
        decompress_rows(gathered, out=buffer)
        self.last_bytes_sent = 2 * (self.world - 1) * wire.shape[1]
        self.bytes_sent += self.last_bytes_sent

    def simulate(self, buffers: Sequence[torch.Tensor], worker_errors: Sequence[torch.Tensor],
                 server_errors: Sequence[torch.Tensor]) -> None:
        """What ``world`` ranks calling this with ``buffers[r]``, ``worker_errors[r]`` and
        ``server_errors[r]`` compute, in one process without communication (in place, the
        same arithmetic); the reference of the tests. ``world`` is ``len(buffers)``."""
        simulate(buffers, worker_errors, server_errors)


def padded_numel(numel: int, world: int) -> int:
    """``numel`` rounded up to a multiple of ``8 * world``."""
    if numel < 0 or world < 1:
        raise ValueError(f"padded_numel needs numel >= 0 and world >= 1, got {numel}, {world}")
    unit = 8 * world
    return -(-numel // unit) * unit


def simulate(buffers: Sequence[torch.Tensor], worker_errors: Sequence[torch.Tensor],
             server_errors: Sequence[torch.Tensor]) -> None:
    """:meth:`CompressedAllreduce.simulate` for ``len(buffers)`` ranks."""
    world = len(buffers)
    if not world or len(worker_errors) != world or len(server_errors) != world:
        raise ValueError("simulate needs one buffer, worker error and server error per rank")
    for b, w, s in zip(buffers, worker_errors, server_errors, strict=True):
        _check_buffers(b, w, s, world)
    if buffers[0].numel() == 0:
        return
    wires = [_worker_phase(b, w, world) for b, w in zip(buffers, worker_errors, strict=True)]
    server_wires = [_server_phase(torch.stack([wire[r] for wire in wires]), server_errors[r])
                    for r in range(world)]
    result = decompress_rows(torch.cat(server_wires)).view(-1)
    for b in buffers:
        b.copy_(result)


def _check_buffers(buffer: torch.Tensor, worker_error: torch.Tensor,
                   server_error: torch.Tensor, world: int) -> None:
    n = buffer.numel()
    if buffer.dtype != torch.float32 or buffer.ndim != 1 or not buffer.is_contiguous():
        raise ValueError(f"the compressed all-reduce takes a flat contiguous fp32 buffer, got "
                         f"{buffer.dtype} of shape {tuple(buffer.shape)}")
    if n != padded_numel(n, world):
        raise ValueError(f"the buffer has {n} elements, not a multiple of 8 * world = "
                         f"{8 * world}: size it with padded_numel()")
    for name, t, size in (("worker_error", worker_error, n),
                          ("server_error", server_error, n // world)):
        if t.dtype != torch.float32 or t.shape != (size,) or not t.is_contiguous():
            raise ValueError(f"{name} must be flat contiguous fp32 of {size} elements, got "
                             f"{t.dtype} of shape {tuple(t.shape)}: make it with new_errors()")
