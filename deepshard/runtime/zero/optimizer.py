"""The optimizer's side of a ZeRO rank: what it steps, where that lives, and the update.

For each flat group the optimizer steps one *step tensor*, this rank's shard:

- fp32 training without offload: the parameter shard itself (a view of the replicated
  buffer at stages 1-2, the partitioned shard at stage 3); no master copy exists;
- fp16/bf16, or offload from an accelerator: an fp32 master shard (on the CPU when
  ``offload_optimizer.device`` is ``cpu``/``nvme``, pinned if asked), copied back into the
  parameter shard after the step.

With ``offload_optimizer.device = "nvme"`` the optimizer state of every group (and the fp32
masters when they are separate) lives in files between steps; the step walks the groups in
order, reading the next groups' state while stepping the current one and writing it back
asynchronously (:mod:`.swap`).

(The engine sums the gradient norm's squares over the ranks, so every rank sees the same
norm and, with fp16, the same overflow decision.)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from deepshard.runtime.zero.flat import FlatGroup
from deepshard.runtime.zero.swap import TensorSwapper


@dataclass(frozen=True)
class OffloadSpec:
    """``zero_optimization.offload_optimizer``, resolved."""

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4

    @classmethod
    def from_config(cls, section) -> OffloadSpec:
        if section is None:
            return cls()
        return cls(section.device, section.nvme_path, section.pin_memory, section.buffer_count)


class ShardStepper:
    """Step tensors, their gradients and the model update of one ZeRO rank."""

    def __init__(self, groups: Sequence[FlatGroup], half: bool, offload: OffloadSpec,
                 pg: dist.ProcessGroup | None, world: int, rank: int):
        self.groups = list(groups)
        self.pg, self.world = pg, world
        self.offload = offload
        host = offload.device in ("cpu", "nvme")
        self.separate: list[bool] = []
        self.step_tensors: list[torch.Tensor] = []
        for k, g in enumerate(self.groups):
            separate = half or (host and g.device.type != "cpu") or g.shard_elsewhere
            if separate:
                device = torch.device("cpu") if host else g.device
                pin = offload.pin_memory and host and torch.cuda.is_available()
                master = torch.empty(g.spec.shard, dtype=torch.float32, device=device,
                                     pin_memory=pin)
                master.copy_(g.read_shard())
            else:
                master = g.shard
            self.separate.append(separate)
            self.step_tensors.append(master)
            g.on_modified = functools.partial(self.refresh_master, k) if separate else None
        self.master_grads: list[Any] = [torch.zeros_like(m) if s else None  # None: not separate
                             for m, s in zip(self.step_tensors, self.separate, strict=True)]
        # nvme_path: required with device nvme (the config checks it)
        self.swapper = TensorSwapper(cast(str, offload.nvme_path), rank, "optimizer") \
            if offload.device == "nvme" else None
        self._swapped: dict[int, dict[str, tuple[torch.Size, torch.dtype]]] = {}
        self._writes: dict[str, Future] = {}
        self._scalars: dict[int, dict[str, object]] = {}
        self._grads: list[torch.Tensor | None] = [None] * len(self.step_tensors)

    def master_of(self) -> dict[int, int]:
        """``id(step tensor)`` → flat group index."""
        return {id(t): k for k, t in enumerate(self.step_tensors)}

    # gradients ---------------------------------------------------------------------------
    def load_grads(self, shard_grads: Sequence[torch.Tensor], inv_scale: float) -> list:
        """The gradients the step will use: this rank's averaged gradient shards (fp32
        masters: a copy, with the loss scale undone). :meth:`step` attaches them."""
        grads = []
        for k, g in enumerate(shard_grads):
            if self.separate[k]:
                mg = self.master_grads[k]
                mg.copy_(g)
                if inv_scale != 1.0:
                    mg.mul_(inv_scale)
                g = mg
            grads.append(g)
        self._grads = grads
        return grads

    # the step ----------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``, group by group through the swap files with NVMe offload."""
        if self.swapper is None:
            for t, g in zip(self.step_tensors, self._grads, strict=True):
                t.grad = g
            optimizer.step()
            return
        order = range(len(self.step_tensors))
        depth = max(1, self.offload.buffer_count // 3)
        reads: dict[int, list[Future]] = {}
        for k in order:
            for ahead in range(k, min(k + depth, len(self.step_tensors))):
                if ahead not in reads:
                    reads[ahead] = self._swap_in(optimizer, ahead)
            for f in reads.pop(k):
                f.result()
            for j, t in enumerate(self.step_tensors):
                t.grad = self._grads[j] if j == k else None
            optimizer.step()
            self.step_tensors[k].grad = None
            self._copy_back(k)
            self._swap_out(optimizer, k)
        for f in list(self._writes.values()):
            f.result()

    def update_model(self) -> None:
        """After the step: masters into the parameter shards, then every replicated group
        all-gathered (partitioned groups are gathered when next used)."""
        if self.swapper is None:
            for k in range(len(self.groups)):
                self._copy_back(k)
        works = [w for w in (g.all_gather_replicated() for g in self.groups) if w is not None]
        for w in works:
            w.wait()

    def refresh_master(self, k: int) -> None:
        """Group ``k``'s fp32 master := its parameter shard (user code changed the
        parameters, ``GatheredParameters(modifier_rank=...)``); into its swap file when the
        master is swapped out."""
        values = self.groups[k].read_shard().float()
        meta = self._swapped.get(k)
        if meta is not None and "master" in meta:
            key = self._key(k, "master")
            if key in self._writes:
                self._writes.pop(key).result()
            assert self.swapper is not None  # masters are swapped out only with NVMe offload
            self.swapper.write(key, values.cpu().contiguous()).result()
            return
        with torch.no_grad():
            self.step_tensors[k].copy_(values)

    def _copy_back(self, k: int) -> None:
        if self.separate[k]:
            self.groups[k].write_shard(self.step_tensors[k])

    # NVMe --------------------------------------------------------------------------------
    def _key(self, k: int, name: str) -> str:
        return f"group{k}.{name}"

    def _swap_in(self, optimizer, k: int) -> list[Future]:
        t = self.step_tensors[k]
        meta = self._swapped.get(k)
        if meta is None:
            return []
        assert self.swapper is not None  # groups are swapped out only with NVMe offload
        futures = []
        state = dict(self._scalars.get(k, {}))
        for name, (shape, dtype) in meta.items():
            key = self._key(k, name)
            if key in self._writes:
                self._writes.pop(key).result()
            buf = torch.empty(shape, dtype=dtype)
            futures.append(self.swapper.read(key, buf))
            if name == "master":
                t.data = buf
            else:
                state[name] = buf
        optimizer.state[t] = state
        return futures

    def _swap_out(self, optimizer, k: int) -> None:
        assert self.swapper is not None  # called only with NVMe offload
        t = self.step_tensors[k]
        state = optimizer.state.pop(t, {})
        meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
        for name, value in state.items():
            if not torch.is_tensor(value) or value.dim() == 0:
                self._scalars.setdefault(k, {})[name] = value
                continue
            meta[name] = (value.shape, value.dtype)
            self._writes[self._key(k, name)] = self.swapper.write(self._key(k, name), value)
        if self.separate[k]:
            meta["master"] = (t.shape, t.dtype)
            self._writes[self._key(k, "master")] = self.swapper.write(self._key(k, "master"),
                                                                      t.data)
            t.data = torch.empty(0, dtype=t.dtype)
        self._swapped[k] = meta

    def swap_in_all(self, optimizer) -> None:
        """Bring every group's state back into memory (before saving a checkpoint)."""
        if self.swapper is None:
            return
        for k in range(len(self.step_tensors)):
            for f in self._swap_in(optimizer, k):
                f.result()
            self._swapped.pop(k, None)

    def swap_out_all(self, optimizer) -> None:
        """Put every group's state back into files (after saving or loading)."""
        if self.swapper is None:
            return
        for k in range(len(self.step_tensors)):
            if k not in self._swapped:
                self._swap_out(optimizer, k)
        for f in list(self._writes.values()):
            f.result()

    # accounting --------------------------------------------------------------------------
    def nbytes(self, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """Bytes of optimizer state and separate fp32 masters (with their gradients) held
        in memory, and bytes held in NVMe files."""
        held = 0
        if optimizer is not None:
            for state in optimizer.state.values():
                held += sum(v.numel() * v.element_size() for v in state.values()
                            if torch.is_tensor(v))
        for t, mg, s in zip(self.step_tensors, self.master_grads, self.separate, strict=True):
            if s:
                held += t.numel() * t.element_size() + mg.numel() * mg.element_size()
        nvme = self.swapper.nbytes() if self.swapper is not None else 0
        return {"optimizer": held, "nvme": nvme}

    def close(self) -> None:
        """Remove the swap files."""
        if self.swapper is not None:
            self.swapper.close()
