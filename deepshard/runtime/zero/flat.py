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

``offload_param`` places a partitioned shard elsewhere: on the CPU (``cpu``, pinned when
asked and a GPU exists; copied to the device for each gather), or in a file (``nvme``: read
for each gather, rewritten after each optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist

from deepshard.comm import collectives as comm
from deepshard.runtime.zero.init import adopt
from deepshard.runtime.zero.partition import FlatLayout, ShardSpec
from deepshard.runtime.zero.quantize import dequantize, pack, quantize, unpack
from deepshard.runtime.zero.status import ZeroParamStatus
from deepshard.runtime.zero.subgroups import SubGroup
from deepshard.runtime.zero.swap import TensorSwapper


class FlatGroup:
    """Parameters of one dtype and optimizer param group laid end to end, sharded over
    ``world`` ranks of ``pg``; see the module docstring."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 flat: FlatLayout, world: int, rank: int, pg: dist.ProcessGroup | None,
                 partitioned: bool, shard_device: torch.device | None = None,
                 pin_memory: bool = False, swapper: TensorSwapper | None = None,
                 key: str = "", hpz: SubGroup | None = None, qwz_block: int = 0,
                 store_block: int = 0):
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
        # ZeRO++ hpZ: after a gather over the whole group, this rank keeps its slice of a
        # second partition over ``hpz`` (a node); backward gathers from those instead
        self.hpz = hpz if partitioned and hpz is not None and hpz.size > 1 else None
        self.secondary: torch.Tensor | None = None
        self._secondary_exact = True  # (made from a dequantized gather under qwZ: not)
        self.secondary_gathers = 0
        """Gathers served from the secondary partition (backward's, under hpZ)."""
        # ZeRO++ qwZ: forward's and backward's gathers carry int8 blocks of qwz_block
        # elements with a scale each (quantize.py); every rank computes with the same
        # dequantized weights, while the shard (what the optimizer steps) stays exact
        self.qwz_block = qwz_block if partitioned and world > 1 else 0
        self._qbuf: torch.Tensor | None = None
        self._dequantized = False
        self.quantized_gathers = 0
        # ZeRO++ zero_quantized_nontrainable_weights: a frozen group's shard is kept as
        # int8 blocks of store_block (with their scales), gathered as such
        self._packed: torch.Tensor | None = None
        self.store_block = 0
        if self.hpz is not None:
            self.hp_lo, self.hp_hi = ShardSpec(self.spec.padded, self.hpz.size).bounds(
                self.hpz.rank)
        self.swapper, self.key = (swapper, key) if partitioned else (None, "")
        self.shard_device = shard_device if partitioned and shard_device else self.device
        self.on_modified: Callable[[], None] | None = None
        self._work = None
        # open GatheredParameters blocks over this group: it stays gathered through them
        # (a forward inside one does not release it)
        self.holds = 0
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        # the ds_tensor views of the shard: (view, its start in the full buffer, numel)
        self._views: list[tuple[torch.Tensor, int, int]] = []
        full = torch.zeros(self.spec.padded, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p, off, n, shape in zip(self.params, flat.offsets, flat.numels, self.shapes,
                                        strict=True):
                full[off:off + n].copy_(adopt(p).reshape(-1))
                # the full shape (p is empty when built by zero.Init or an earlier engine)
                p.ds_shape, p.ds_numel = torch.Size(shape), n
        # partitioned groups gather into this one tensor, whose storage is freed on
        # release and allocated again on gather: views autograd saved during forward
        # (e.g. a weight's transpose) then see the re-gathered values in backward instead
        # of keeping a stale copy of the whole buffer alive in between
        self._buffer = full
        if partitioned:
            pin = pin_memory and self.shard_device.type == "cpu" and torch.cuda.is_available()
            self.shard = torch.empty(self.spec.shard, dtype=self.dtype,
                                     device=self.shard_device, pin_memory=pin)
            self.shard.copy_(full[self.lo:self.hi])
            if self.swapper is not None:
                self.swapper.write(self.key, self.shard).result()
                self.shard = None
            elif store_block:
                self.store_block = store_block
                self._packed = pack(*quantize(self.shard, store_block))
                self.shard = None
            self.release()
            self._show_shards()  # the shard is written in place from now on: views stay true
        else:
            self.full = full
            self.shard = full[self.lo:self.hi]
            self.attach()

    @property
    def gathered(self) -> bool:
        """Whether the full parameters are available (always, when replicated)."""
        return self.full is not None and self._work is None

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous gather was started and not yet waited for."""
        return self._work is not None

    def gather(self, async_op: bool = False, quantized: bool = False) -> None:
        """Make the full parameters available (partitioned groups); ``async_op`` starts the
        all-gather and returns; :meth:`wait` (or a later ``gather``) completes it.
        ``quantized``: a gather for forward or backward, which qwZ may compress (others,
        e.g. ``GatheredParameters`` to save the model, are exact)."""
        if self.full is None:
            storage = self._buffer.untyped_storage()
            storage.resize_(self.spec.padded * self._buffer.element_size())
            self.full = self._buffer
            src = self.read_shard().to(self.device, non_blocking=True)
            if self.spec.world == 1:
                self.full.copy_(src)
                self.attach()
            elif self.secondary is not None and torch._C._current_graph_task_id() != -1:
                # in backward: from the node-local copy (the same values, exactly)
                self.secondary_gathers += 1
                self._dequantized = not self._secondary_exact  # then the shard stays apart
                assert self.hpz is not None
                self._work = comm.all_gather_into_tensor(self.full, self.secondary,
                                                         group=self.hpz.pg, async_op=True)
                self._set_status(ZeroParamStatus.INFLIGHT)
            elif self._packed is not None or (quantized and self.qwz_block):
                self.quantized_gathers += 1
                packed = self._packed.to(self.device, non_blocking=True) \
                    if self._packed is not None else pack(*quantize(src, self.qwz_block))
                self._qbuf = torch.empty(packed.numel() * self.spec.world, dtype=torch.uint8,
                                         device=self.device)
                self._work = comm.all_gather_into_tensor(self._qbuf, packed, group=self.pg,
                                                         async_op=True)
                self._set_status(ZeroParamStatus.INFLIGHT)
            else:
                self._work = comm.all_gather_into_tensor(self.full, src, group=self.pg,
                                                         async_op=True)
                self._set_status(ZeroParamStatus.INFLIGHT)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Finish an asynchronous gather and point the parameters at the full buffer."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._qbuf is not None:
                self._dequantize(self._qbuf)
                self._qbuf = None
            self.attach()
            self._lodge_shard()
            if self.hpz is not None and self.secondary is None:
                self.secondary = cast(torch.Tensor, self.full)[self.hp_lo:self.hp_hi].clone()
                self._secondary_exact = not self._dequantized

    def _dequantize(self, gathered: torch.Tensor) -> None:
        """Every rank's shard, this one's too, from the gathered int8 blocks."""
        full = cast(torch.Tensor, self.full)
        shard, each = self.spec.shard, gathered.numel() // self.spec.world
        for r in range(self.spec.world):
            values, scales = unpack(gathered[r * each:(r + 1) * each], shard,
                                    self.store_block if self._packed is not None
                                    else self.qwz_block)
            dequantize(values, scales, shard, out=full[r * shard:(r + 1) * shard])
        self._dequantized = True

    def drop_secondary(self) -> None:
        """The shard changed (a step, a load, a write): hpZ's copy is stale until the next
        gather over the whole group makes it again."""
        self.secondary = None

    def _lodge_shard(self) -> None:
        """While gathered, the shard lives in its slice of the full buffer (which holds the
        same values) and its own storage is freed: a gathered group costs its full size,
        not full plus shard. The shard tensor (the optimizer's parameter) and its
        ``ds_tensor`` views keep their identity; :meth:`_unlodge_shard` moves them out."""
        if self.shard_elsewhere or self.spec.world == 1 or self._dequantized:
            return  # (dequantized: the buffer holds the shard's approximation, not it)
        storage = cast(torch.Tensor, self.full).untyped_storage()  # gathered
        with torch.no_grad():
            self.shard.set_(storage, self.lo, (self.spec.shard,))
            self.repoint_views(storage, 0)

    def _unlodge_shard(self) -> None:
        """Before the full buffer goes: the shard back into a storage of its own."""
        full = self.full
        if self.shard_elsewhere or full is None or \
                self.shard.untyped_storage().data_ptr() != full.untyped_storage().data_ptr():
            return
        own = full[self.lo:self.hi].clone()
        with torch.no_grad():
            self.shard.set_(own.untyped_storage(), 0, (self.spec.shard,))
            self.repoint_views(own.untyped_storage(), -self.lo)

    def repoint_views(self, storage: torch.UntypedStorage, shift: int) -> None:
        """``ds_tensor`` views onto ``storage`` (the shard starts at ``self.lo + shift``
        in it, counted from the full buffer's start)."""
        for view, lo, n in self._views:
            view.set_(storage, lo + shift, (n,))

    def release(self, keep_taken: bool = False) -> None:
        """Drop the full buffer of a partitioned group (its shard stays). ``keep_taken``:
        tensors taken from the gathered parameters (a ``state_dict()`` inside
        ``GatheredParameters``) stay valid, holding the values of that moment, as with
        DeepSpeed: the buffer is let go rather than freed in place, and the next gather
        fills a new one. A group an open ``GatheredParameters`` block holds stays."""
        if not self.partitioned or self.holds:
            return
        self.wait()
        self._unlodge_shard()
        self.full = None
        self._dequantized = False
        for p in self.params:
            p.data = self._empty
        if keep_taken:
            self._buffer = torch.empty(self.spec.padded, dtype=self.dtype, device=self.device)
        self._buffer.untyped_storage().resize_(0)
        self._set_status(ZeroParamStatus.NOT_AVAILABLE)

    def attach(self) -> None:
        """Point the parameters' ``.data`` at their views of the full buffer."""
        full = cast(torch.Tensor, self.full)  # gathered
        for p, off, n, shape in zip(self.params, self.flat.offsets, self.flat.numels,
                                    self.shapes, strict=True):
            p.data = full[off:off + n].view(shape)
        self._set_status(ZeroParamStatus.AVAILABLE)

    def _set_status(self, status: ZeroParamStatus) -> None:
        """DeepSpeed's ``param.ds_status`` on every parameter of the group."""
        for p in self.params:
            p.ds_status = status

    def _show_shards(self) -> None:
        """DeepSpeed's ``param.ds_tensor``: the part of each parameter this rank holds, a
        view of the shard (empty where the shard holds none of it, or lives in a file)."""
        shard = self.shard if self.swapper is None and self._packed is None else None
        for p, off, n in zip(self.params, self.flat.offsets, self.flat.numels, strict=True):
            lo, hi = max(off, self.lo), min(off + n, self.hi)
            p.ds_tensor = shard[lo - self.lo:hi - self.lo] if shard is not None and hi > lo \
                else self._empty
            if p.ds_tensor is not self._empty:
                self._views.append((p.ds_tensor, lo, hi - lo))

    def all_gather_replicated(self):
        """After the step: every rank's updated shard into every rank's full buffer
        (replicated groups; in place). Returns the async work, or ``None``."""
        if self.partitioned or self.spec.world == 1:
            return None
        return comm.all_gather_into_tensor(self.full, self.shard, group=self.pg, async_op=True)

    def broadcast_full(self, src_rank: int) -> None:
        """Overwrite the gathered full buffer with ``src_rank``'s (group rank) and take this
        rank's shard from it (used after user code modified gathered parameters)."""
        if self.spec.world > 1:
            src = dist.get_global_rank(self.pg, src_rank) if self.pg is not None else src_rank
            comm.broadcast(self.full, src=src, group=self.pg)
        if self.partitioned:
            self.write_shard(cast(torch.Tensor, self.full)[self.lo:self.hi])  # gathered

    def read_shard(self) -> torch.Tensor:
        """This rank's shard (from its file, with ``offload_param`` nvme; dequantized, when
        stored quantized)."""
        if self._packed is not None:
            values, scales = unpack(self._packed, self.spec.shard, self.store_block)
            return dequantize(values, scales, self.spec.shard, dtype=self.dtype)
        if self.swapper is None:
            return self.shard
        buf = torch.empty(self.spec.shard, dtype=self.dtype)
        self.swapper.read(self.key, buf).result()
        return buf

    def write_shard(self, values: torch.Tensor) -> None:
        """Replace this rank's shard with ``values`` (cast to the group's dtype)."""
        self.drop_secondary()
        if self._packed is not None:
            self._packed = pack(*quantize(values.detach().to(self.dtype), self.store_block))
            return
        if self.swapper is None:
            with torch.no_grad():
                self.shard.copy_(values)
            return
        # a copy: the swapper hands the bytes to numpy, which pins the storage's size, and
        # values may be a view of the gather buffer, whose storage is resized on release
        buf = values.detach().to(device="cpu", dtype=self.dtype, copy=True)
        self.swapper.write(self.key, buf).result()

    def write_shard_piece(self, where: slice, values: torch.Tensor) -> None:
        """Overwrite ``shard[where]`` with ``values`` (cast to the group's dtype)."""
        self.drop_secondary()
        if self.swapper is None and self._packed is None:
            with torch.no_grad():
                self.shard[where].copy_(values)
            return
        shard = self.read_shard()
        shard[where].copy_(values)
        self.write_shard(shard)

    @property
    def shard_elsewhere(self) -> bool:
        """Whether the shard is not an in-memory tensor on the compute device."""
        return self.swapper is not None or self._packed is not None or \
            self.shard_device != self.device

    def nbytes_nvme(self) -> int:
        """Bytes of this rank's shard held in a file."""
        return self.spec.shard * self._empty.element_size() if self.swapper else 0

    def param_numel(self) -> int:
        """Elements of real data in the group."""
        return self.flat.numel

    def nbytes_params(self) -> int:
        """Bytes of parameter storage this rank holds between uses."""
        size = self._empty.element_size()
        if self.swapper is not None:
            return 0
        if self._packed is not None:
            return self._packed.numel()
        held = self.spec.shard if self.partitioned else self.spec.padded
        return (held + (self.secondary.numel() if self.secondary is not None else 0)) * size
