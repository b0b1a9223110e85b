"""A flat group of parameters and its shard on this rank: storage, gather and release.

Two kinds of storage:

- *replicated* (stages 1-2, and stage 3's small "persistent" parameters): the group's
  padded flat buffer lives on every rank and the module's parameters are views into it;
  the rank's shard is a view of its slice. After the optimizer step the shards are
  all-gathered in place.
- *partitioned* (stage 3): only the shard lives between uses; :meth:`FlatGroup.gather`
  all-gathers the full buffer and points the parameters' ``.data`` at views of it, and
  :meth:`FlatGroup.release` drops it again (the parameters then hold empty tensors, and
  their full shape is kept in ``ds_shape`` as in DeepSpeed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .init import adopt
from .partition import FlatLayout, ShardSpec


class FlatGroup:
    """Parameters of one dtype and optimizer param group laid end to end, sharded over
    ``world`` ranks of ``pg``; see the module docstring."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 flat: FlatLayout, world: int, rank: int, pg: dist.ProcessGroup | None,
                 partitioned: bool):
        self.params = list(params)
        self.names = tuple(names)
        self.flat = flat
        self.spec = ShardSpec(flat.numel, world)
        self.rank, self.pg, self.partitioned = rank, pg, partitioned
        self.shapes = tuple(getattr(p, "ds_shape", None) or p.shape for p in self.params)
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.lo, self.hi = self.spec.bounds(rank)
        self.full: torch.Tensor | None = None
        self._work = None
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        full = torch.zeros(self.spec.padded, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p, off, n in zip(self.params, flat.offsets, flat.numels, strict=True):
                full[off:off + n].copy_(adopt(p).reshape(-1))
                p.ds_shape, p.ds_numel = p.shape, n
        if partitioned:
            self.shard = full[self.lo:self.hi].clone()
            self.release()
        else:
            self.full = full
            self.shard = full[self.lo:self.hi]
            self._attach()

    @property
    def gathered(self) -> bool:
        """Whether the full parameters are available (always, when replicated)."""
        return self.full is not None and self._work is None

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous gather was started and not yet waited for."""
        return self._work is not None

    def gather(self, async_op: bool = False) -> None:
        """Make the full parameters available (partitioned groups); ``async_op`` starts the
        all-gather and returns; :meth:`wait` (or a later ``gather``) completes it."""
        if self.full is None:
            self.full = torch.empty(self.spec.padded, dtype=self.dtype, device=self.device)
            if self.spec.world == 1:
                self.full.copy_(self.shard)
            else:
                self._work = dist.all_gather_into_tensor(self.full, self.shard, group=self.pg,
                                                         async_op=True)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Finish an asynchronous gather and point the parameters at the full buffer."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._attach()

    def release(self) -> None:
        """Drop the full buffer of a partitioned group (its shard stays)."""
        if not self.partitioned:
            return
        self.wait()
        self.full = None
        for p in self.params:
            p.data = self._empty

    def _attach(self) -> None:
        for p, off, n, shape in zip(self.params, self.flat.offsets, self.flat.numels,
                                    self.shapes, strict=True):
            p.data = self.full[off:off + n].view(shape)

    def all_gather_replicated(self):
        """After the step: every rank's updated shard into every rank's full buffer
        (replicated groups; in place). Returns the async work, or ``None``."""
        if self.partitioned or self.spec.world == 1:
            return None
        return dist.all_gather_into_tensor(self.full, self.shard, group=self.pg, async_op=True)

    def broadcast_full(self, src_rank: int) -> None:
        """Overwrite the gathered full buffer with ``src_rank``'s (group rank) and take this
        rank's shard from it (used after user code modified gathered parameters)."""
        if self.spec.world > 1:
            src = dist.get_global_rank(self.pg, src_rank) if self.pg is not None else src_rank
            dist.broadcast(self.full, src=src, group=self.pg)
        if self.partitioned:
            self.shard.copy_(self.full[self.lo:self.hi])

    def param_numel(self) -> int:
        """Elements of real data in the group."""
        return self.flat.numel

    def nbytes_params(self) -> int:
        """Bytes of parameter storage this rank holds between uses."""
        size = torch.tensor([], dtype=self.dtype).element_size()
        return (self.spec.shard if self.partitioned else self.spec.padded) * size
