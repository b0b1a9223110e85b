"""DeepSpeed's ``engine.offload_states()`` / ``reload_states()``: a ZeRO engine's states
moved to host memory between training phases (RLHF trainers free the accelerator for
generation this way) and back.

Every tensor keeps its identity: its storage is swapped (``.data``, or ``set_`` for the
shard views), so the optimizer, the flat groups and the parameters all see the move. The
kinds are DeepSpeed's :class:`OffloadStateTypeEnum`:

- ``optim_states``: the optimizer's state tensors (Adam's moments);
- ``hp_params``: the fp32 master shards and their gradients (only kept apart from the
  parameters under fp16/bf16 or optimizer offload);
- ``lp_params``: the parameters' flat buffers (stage 3: this rank's shards; stages 1-2:
  the whole buffers the module's parameters are views of);
- ``lp_grads``: the reduced gradient buffers;
- ``contiguous_grad_buffer``: the staging buffers of the reductions (empty between steps:
  nothing to move).

A tensor already on the target device stays (with ``offload_optimizer`` the optimizer's
states are on the host all along). Unlike DeepSpeed's stage 3, which allows only its
FusedAdam, any optimizer's states move.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any, cast

import torch

from deepshard.errors import UsageError
from deepshard.runtime.zero.flat import FlatGroup

logger = logging.getLogger(__name__)


class OffloadDeviceEnum(str, Enum):
    """DeepSpeed's offload targets (``deepspeed.runtime.zero.offload_config``)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """DeepSpeed's kinds of engine state that :meth:`offload_states` moves."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


# a moved tensor: (the tensor, its device before the move)
Moved = list[tuple[torch.Tensor, torch.device]]


WHERE = "engine.offload_states"


class StateMover:
    """The offloaded states of one ZeRO engine (``strategy``: its ZeroStrategy) and how to
    bring them back."""

    def __init__(self, strategy: Any, optimizer: torch.optim.Optimizer):
        self.strategy, self.optimizer = strategy, optimizer
        self.offloaded: dict[OffloadStateTypeEnum, Moved] = {}
        self._home: dict[int, torch.device] = {}  # id(flat group) -> its buffers' device

    @classmethod
    def for_engine(cls, strategy: Any, optimizer: torch.optim.Optimizer | None,
                   spec: Any) -> StateMover:
        """The mover of an engine, or a :class:`UsageError` where DeepSpeed refuses too
        (stage 0, no optimizer, ``offload_param``)."""
        if not getattr(strategy, "stage", 0) or optimizer is None:
            raise UsageError("engine.offload_states()/reload_states() need a ZeRO stage 1-3 "
                             "engine with an optimizer", where=WHERE,
                             hint="set zero_optimization.stage and pass an optimizer")
        if spec is not None and spec.offload_param.device != "none":
            raise UsageError("moving states across devices is not supported with offloaded "
                             "parameters", where="zero_optimization.offload_param",
                             hint="drop offload_param, or keep the states where they are")
        return cls(strategy, optimizer)

    @property
    def away(self) -> bool:
        """Whether some offloaded state is not where training needs it."""
        return any(self.offloaded.values()) or any(
            g.shard.device != home for g in self._groups()
            if (home := self._home.get(id(g))) is not None)

    def offload(self, include: Iterable[Any] | None, device: Any, pin_memory: bool,
                non_blocking: bool) -> None:
        """Move the ``include`` kinds (all when ``None``) not yet offloaded to ``device``
        (DeepSpeed's :class:`OffloadDeviceEnum`: only ``cpu`` moves; ``none`` warns)."""
        target = _device(device)
        if target is None:
            return
        kinds = _kinds(include)
        pin = pin_memory and torch.cuda.is_available()

        def to(t: torch.Tensor) -> torch.Tensor:
            if pin and t.device != target:
                out = torch.empty_like(t, device=target).pin_memory()
                out.copy_(t, non_blocking=non_blocking)
                return out
            return t.to(target, non_blocking=non_blocking)

        for kind in kinds:
            if kind not in self.offloaded:
                self.offloaded[kind] = self._move(kind, to, target)

    def reload(self, non_blocking: bool) -> None:
        """Every offloaded state back where it was."""
        for kind in list(self.offloaded):
            moved = self.offloaded.pop(kind)
            if kind is OffloadStateTypeEnum.lp_params:
                for g in self._groups():
                    home = self._home[id(g)]
                    self._move_group(g, functools.partial(_to, device=home,
                                                          non_blocking=non_blocking))
                continue
            for t, home in moved:
                t.data = t.data.to(home, non_blocking=non_blocking)
            if kind is OffloadStateTypeEnum.lp_grads:
                self._rebind_grads()

    # the kinds ---------------------------------------------------------------------------
    def _move(self, kind: OffloadStateTypeEnum, to: Callable[[torch.Tensor], torch.Tensor],
              device: torch.device) -> Moved:
        if kind is OffloadStateTypeEnum.lp_params:
            for g in self._groups():
                self._home[id(g)] = g.device
                self._move_group(g, to)
            return []
        if kind is OffloadStateTypeEnum.contiguous_grad_buffer:
            pool = getattr(self.strategy.grads, "pool", None)
            if pool is not None:
                pool.clear()
            return []
        moved: Moved = []
        for t in self._tensors(kind):
            if t.device != device and t.numel():
                moved.append((t, t.device))
                t.data = to(t.data)
        if kind is OffloadStateTypeEnum.lp_grads:
            self._rebind_grads()
        return moved

    def _rebind_grads(self) -> None:
        """Stage 1's parameters hold views of its gradient buffers as ``.grad``."""
        rebind = getattr(self.strategy.grads, "rebind_views", None)
        if rebind is not None:
            rebind()

    def _tensors(self, kind: OffloadStateTypeEnum) -> list[torch.Tensor]:
        stepper, grads = self.strategy.stepper, self.strategy.grads
        if kind is OffloadStateTypeEnum.optim_states:
            return [v for state in self.optimizer.state.values() for v in state.values()
                    if torch.is_tensor(v)]
        if kind is OffloadStateTypeEnum.hp_params:
            return [t for t, apart in zip(stepper.step_tensors, stepper.separate, strict=True)
                    if apart] + [g for g in stepper.master_grads if g is not None]
        # lp_grads: stage 2-3's gradient shards, or stage 1's whole buffers
        return list(getattr(grads, "shards", None) or getattr(grads, "buffers", []))

    def _groups(self) -> list[FlatGroup]:
        return [g for g in (*self.strategy.groups, *self.strategy.frozen_groups)
                if not g.shard_elsewhere]

    @staticmethod
    def _move_group(g: FlatGroup, to: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A flat group's storage onto another device: the shard of a partitioned group
        (its ``ds_tensor`` views follow), the whole buffer of a replicated one (its
        parameters and shard views follow)."""
        with torch.no_grad():
            if g.partitioned:
                g.shard.data = to(g.shard.data)
                g.repoint_views(g.shard.untyped_storage(), -g.lo)
            else:
                full = cast(torch.Tensor, g.full)  # replicated groups are always whole
                full.data = to(full.data)
                g.shard.data = full.data[g.lo:g.hi]
                g.attach()


def _to(t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    return t.to(device, non_blocking=non_blocking)


def _device(device: Any) -> torch.device | None:
    value = getattr(device, "value", device)
    if value == "cpu":
        return torch.device("cpu")
    if value == "none":
        logger.warning("engine.offload_states(device='none'): no device given, nothing moved")
        return None
    if value == "nvme":
        raise UsageError("NVMe offload is not supported for offloading states", where=WHERE,
                         hint="use device='cpu'")
    raise UsageError(f"unknown offload device {device!r}", where=WHERE,
                     hint="use device='cpu' (OffloadDeviceEnum.cpu)")


def _kinds(include: Iterable[Any] | None) -> list[OffloadStateTypeEnum]:
    if include is None:
        return list(OffloadStateTypeEnum)
    known = {k.value for k in OffloadStateTypeEnum}
    kinds = []
    for k in include:
        value = getattr(k, "value", k)
        if value not in known:
            raise UsageError(f"unknown state kind {k!r} in include", where=WHERE,
                             hint="choose among " + ", ".join(sorted(known)))
        kinds.append(OffloadStateTypeEnum(value))
    return kinds
