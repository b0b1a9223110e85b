"""The two collectives of tensor-parallel inference, fast for the tiny tensors of decoding.

Generating one token at tensor-parallel size T makes two all-reduces per transformer block
of a ``[batch, 1, hidden]`` tensor (a few KiB). On a CPU, gloo's all-reduce of 3 KiB takes
~1.1-1.5 ms between two ranks of one host (measured on this project's 2-core machine),
far more than the matmuls it joins: GPT-2 small at tp 2 spent about half of each token in
it. :class:`TPComm` picks, per call:

- **shared memory**, when every rank of the group is on this host, on x86-64, with CPU
  tensors: each rank writes its tensor into its slot of a buffer all of them map, then
  publishes a sequence number; each reads the others' slots once their numbers arrive and
  sums them *in rank order*, so every rank gets the same bits. Two slot sets alternate, so
  a rank may run one call ahead without overwriting what a slower one still reads. (x86's
  ordering of stores makes a published number imply its slot's data; other CPUs take
  gloo.) The buffer is a file in ``/dev/shm`` removed as soon as every rank has mapped it:
  nothing is left behind, whatever ends the job. A tensor larger than a slot (a prompt's
  whole activations) goes through gloo.
- otherwise torch.distributed: on gloo an all-reduce of at most ``SMALL`` bytes is an
  all-gather summed locally in rank order (gloo's all-gather is 2-3x faster than its
  all-reduce at these sizes), a larger one gloo's all-reduce; NCCL's all-reduce as it is.
"""

from __future__ import annotations

import os
import platform
import time
import uuid
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from deepshard.errors import UsageError

SLOT = 1 << 20
"""Bytes of one rank's slot (a tensor up to this size takes shared memory)."""
SMALL = 64 << 10
"""Gloo all-reduces up to this many bytes are done as an all-gather and a local sum."""
_LINE = 64
"""Each rank's sequence number sits on its own cache line."""
_TIMEOUT_S = 600.0


class TPComm:
    """All-reduce and all-gather over one tensor-parallel group (see the module docstring);
    build it with :meth:`create` on every rank of the group."""

    def __init__(self, group: Any, world: int, rank: int, shm: torch.Tensor | None) -> None:
        self.group = group
        self.world = world
        self.rank = rank
        self._shm = shm
        self._seq = 0
        self._gloo = world > 1 and str(dist.get_backend(group)) == "gloo"
        if shm is not None:
            self._counters = shm[:world * _LINE].numpy().view(np.int64)[::_LINE // 8]
            self._slots = shm[world * _LINE:].view(2, world, SLOT)

    @classmethod
    def create(cls, group: Any, world: int, rank: int) -> TPComm:
        """A collective call on every rank of ``group`` (shared memory is set up when the
        whole group is on this host)."""
        if world == 1:
            return cls(group, 1, 0, None)
        return cls(group, world, rank, _map_shared(group, world, rank))

    @property
    def shared_memory(self) -> bool:
        """Whether small tensors go through shared memory."""
        return self._shm is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group of ``x``, the same bits on every rank (in place when it
        can be)."""
        if self.world == 1:
            return x
        if self._fits(x):
            parts = self._exchange(x)
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            return x.copy_(total.view_as(x))
        if self._gloo and x.numel() * x.element_size() <= SMALL:
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            total = parts[0]
            for part in parts[1:]:
                total += part
            return total
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        if self.world == 1:
            return x
        if self._fits(x):
            parts = [p.view_as(x) for p in self._exchange(x)]
        else:
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def _fits(self, x: torch.Tensor) -> bool:
        return self._shm is not None and x.device.type == "cpu" and \
            x.numel() * x.element_size() <= SLOT

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``x`` and return every rank's (views of the shared slots, valid until
        the call after next)."""
        self._seq += 1
        side = self._slots[self._seq % 2]
        n = x.numel() * x.element_size()
        side[self.rank, :n].copy_(x.contiguous().view(-1).view(torch.uint8))
        self._counters[self.rank] = self._seq
        spins, start = 0, None
        while self._counters.min() < self._seq:
            spins += 1
            if spins % 64 == 0:
                os.sched_yield()
                start = start or time.monotonic()
                if time.monotonic() - start > _TIMEOUT_S:
                    raise UsageError(f"tensor-parallel rank waited {_TIMEOUT_S:.0f} s for its "
                                     "peers", where="init_inference",
                                     hint="every rank of the group must run the same "
                                          "forward / generate calls")
        return [side[r, :n].view(x.dtype) for r in range(self.world)]


def _map_shared(group: Any, world: int, rank: int) -> torch.Tensor | None:
    """The shared buffer mapped on every rank of ``group``, or None (another host, not
    x86-64, no ``/dev/shm``): decided together, so all ranks agree."""
    import socket

    local = platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")
    mine = [socket.gethostname() if local else None, f"/dev/shm/deepshard-tp-{uuid.uuid4().hex}"]
    every: list = [None] * world
    dist.all_gather_object(every, mine, group=group)
    if any(host is None or host != every[0][0] for host, _ in every):
        return None
    path = every[0][1]
    size = world * _LINE + 2 * world * SLOT
    shm = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    if rank == 0:
        shm[:world * _LINE].zero_()
    dist.barrier(group=group)
    if rank == 0:
        os.unlink(path)  # every rank has it mapped: the name is no longer needed
    dist.barrier(group=group)
    return shm
