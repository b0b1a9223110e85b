"""One parameter's whole fp32 master, gradient and optimizer state, wherever a strategy
keeps them: what DeepSpeed's ``safe_get_full_*`` functions (:mod:`deepshard.utils`) read.

Stage 0 holds everything on every rank (the fp32 master, when there is one, is a tensor of
its own). ZeRO holds this rank's slice of each flat group: the piece of one parameter is
all-gathered over the data-parallel group, so at stages 1-3 every rank of that group must
make the same call (as in DeepSpeed). Gradients are the reduced ones, read between
backward and ``step()``; with fp16 they still carry the loss scale at stage 0, as
DeepSpeed's do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deepshard.errors import UsageError


def stage0_full(strategy, param: torch.Tensor, what: str, optimizer=None,
                key: str | None = None) -> torch.Tensor | None:
    """``what`` (``"param"``, ``"grad"`` or ``"state"``) of ``param`` at stage 0."""
    masters = strategy.masters.master_of() if strategy.masters is not None else {}
    held = masters.get(id(param), param)
    if what == "param":
        return held.detach().float().clone()
    if what == "grad":
        i = _index(strategy, param)
        return strategy.buckets.views[i].detach().float().clone()
    state = optimizer.state.get(held, {}) if optimizer is not None else {}
    value: Any = state.get(key)
    return value.detach().clone() if torch.is_tensor(value) else value


def zero_full(strategy, param: torch.Tensor, what: str, optimizer=None,
              key: str | None = None) -> torch.Tensor | None:
    """``what`` of ``param`` at ZeRO stages 1-3, all-gathered from the shards."""
    where = _locate(strategy, param)
    if where is None:
        return None  # frozen: no master, gradient or state
    k, off, n = where
    shard: Any
    if what == "param":
        shard = strategy.stepper.step_tensors[k]
    elif what == "grad":
        shard = strategy.grads.shard_grads()[k]
    else:
        state = optimizer.state.get(strategy.stepper.step_tensors[k], {}) \
            if optimizer is not None else {}
        shard = state.get(key)
        if not torch.is_tensor(shard) or shard.dim() == 0:
            return shard
    whole = _gather(shard.detach(), strategy.shard_group, strategy.shard_world)
    return whole[off:off + n].float().view(getattr(param, "ds_shape", None) or param.shape)


def _locate(strategy, param: torch.Tensor) -> tuple[int, int, int] | None:
    """``(flat group, offset, numel)`` of ``param`` in a ZeRO strategy's groups; ``None``
    for a frozen one (in no group)."""
    i = _index(strategy, param)
    k = next((k for k, g in enumerate(strategy.groups) if i in g.flat.params), None)
    if k is None:
        return None
    flat = strategy.groups[k].flat
    j = flat.params.index(i)
    return k, flat.offsets[j], flat.numels[j]


def _gather(shard: torch.Tensor, group, world: int) -> torch.Tensor:
    if world == 1:
        return shard.clone()
    out = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(out, shard.contiguous(), group=group)
    return out


def _index(strategy, param: torch.Tensor) -> int:
    for i, p in enumerate(strategy.params):
        if p is param:
            return i
    raise UsageError("the parameter is not one this engine trains", where="safe_get_full_*",
                     hint="pass a parameter of engine.module that requires grad")


class ParamFragments:
    """What ``param._deepshard_strategy`` holds for each parameter an engine trains: its
    strategy and optimizer, answering :mod:`deepshard.runtime.tensor_fragment`'s calls."""

    def __init__(self, strategy, optimizer):
        self.strategy, self.optimizer = strategy, optimizer

    def _owner(self, param: torch.Tensor):
        """The plain strategy holding ``param``: a composite strategy's part (MoE's
        ``owner_of``), else the strategy itself."""
        owner_of = getattr(self.strategy, "owner_of", None)
        return self.strategy if owner_of is None else owner_of(param)

    def _full(self, param: torch.Tensor, what: str, key: str | None = None):
        owner = self._owner(param)
        full = zero_full if owner.stage else stage0_full
        return full(owner, param, what, self.optimizer, key)

    def full_fp32_param(self, param: torch.Tensor) -> torch.Tensor | None:
        return self._full(param, "param")

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        return self._full(param, "grad")

    def full_optimizer_state(self, param: torch.Tensor, key: str):
        return self._full(param, "state", key)

    # setters: every rank of the data-parallel group calls them with the same value (as in
    # DeepSpeed); each writes its own part, no communication
    @torch.no_grad()
    def set_full_fp32_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """The master becomes ``value``, and so does the parameter the model computes with
        (DeepSpeed's ZeRO waits for the next step to copy it there)."""
        owner = self._owner(param)
        if not owner.stage:
            masters = owner.masters.master_of() if owner.masters else {}
            if id(param) in masters:
                masters[id(param)].copy_(value.reshape(param.shape))
            param.copy_(value.reshape(param.shape))
            return
        k, piece, mine = _piece(owner, param)
        owner.stepper.step_tensors[k][mine].copy_(value.reshape(-1)[piece])
        g = owner.groups[k]
        if g.partitioned:
            if owner.stepper.separate[k]:
                g.write_shard_piece(mine, value.reshape(-1)[piece])
            if g.full is not None:  # gathered now: the whole parameter too
                param.copy_(value.reshape(param.shape))
        else:
            param.copy_(value.reshape(param.shape))

    @torch.no_grad()
    def set_full_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """The reduced gradient the next ``step()`` uses becomes ``value``."""
        owner = self._owner(param)
        if not owner.stage:
            owner.buckets.views[_index(owner, param)].copy_(value.reshape(param.shape))
            return
        k, piece, mine = _piece(owner, param)
        owner.grads.shard_grads()[k][mine].copy_(value.reshape(-1)[piece])

    @torch.no_grad()
    def set_full_optimizer_state(self, param: torch.Tensor, value: torch.Tensor,
                                 key: str) -> None:
        """Optimizer state ``key`` (``"exp_avg"``...) of ``param`` becomes ``value``."""
        owner = self._owner(param)
        if not owner.stage:
            masters = owner.masters.master_of() if owner.masters is not None else {}
            _state(self.optimizer, masters.get(id(param), param), key).copy_(
                value.reshape(param.shape))
            return
        k, piece, mine = _piece(owner, param)
        _state(self.optimizer, owner.stepper.step_tensors[k], key)[mine].copy_(
            value.reshape(-1)[piece])

    # ZeRO-3's local API: this rank's part of a parameter, flat -------------------------
    def local_fp32_param(self, param: torch.Tensor) -> torch.Tensor:
        k, _, mine = _piece(self._stage3(param, "safe_get_local_fp32_param"), param)
        return self._owner(param).stepper.step_tensors[k][mine]

    def local_grad(self, param: torch.Tensor) -> torch.Tensor:
        k, _, mine = _piece(self._stage3(param, "safe_get_local_grad"), param)
        return self._owner(param).grads.shard_grads()[k][mine]

    def local_optimizer_state(self, param: torch.Tensor, key: str) -> torch.Tensor:
        k, _, mine = _piece(self._stage3(param, "safe_get_local_optimizer_state"), param)
        return _state(self.optimizer, self._owner(param).stepper.step_tensors[k], key)[mine]

    @torch.no_grad()
    def set_local_fp32_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        owner = self._stage3(param, "safe_set_local_fp32_param")
        k, _, mine = _piece(owner, param)
        owner.stepper.step_tensors[k][mine].copy_(value.reshape(-1))
        if owner.stepper.separate[k]:
            owner.groups[k].write_shard_piece(mine, value.reshape(-1))

    @torch.no_grad()
    def set_local_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        self.local_grad(param).copy_(value.reshape(-1))

    @torch.no_grad()
    def set_local_optimizer_state(self, param: torch.Tensor, value: torch.Tensor,
                                  key: str) -> None:
        self.local_optimizer_state(param, key).copy_(value.reshape(-1))

    def _stage3(self, param: torch.Tensor, api: str):
        owner = self._owner(param)
        if owner.stage != 3:
            raise UsageError(f"{api} is defined for ZeRO-3 parameters; this engine runs "
                             f"stage {owner.stage}", where=api,
                             hint="use the safe_get_full_*/safe_set_full_* functions")
        return owner


def _piece(strategy, param: torch.Tensor) -> tuple[int, slice, slice]:
    """Where this rank holds part of ``param``: its flat group, the part as a slice of the
    flattened parameter and as a slice of the group's shard (empty when it holds none)."""
    where = _locate(strategy, param)
    if where is None:
        raise UsageError("the parameter is frozen: it has no master, gradient or optimizer "
                         "state to set", where="safe_set_*",
                         hint="pass a parameter that requires grad")
    k, off, n = where
    g = strategy.groups[k]
    lo, hi = max(off, g.lo), min(off + n, g.hi)
    if hi <= lo:
        return k, slice(0, 0), slice(0, 0)
    return k, slice(lo - off, hi - off), slice(lo - g.lo, hi - g.lo)


def _state(optimizer, held: torch.Tensor, key: str) -> torch.Tensor:
    value = optimizer.state.get(held, {}).get(key) if optimizer is not None else None
    if not torch.is_tensor(value):
        raise UsageError(f"the optimizer holds no state {key!r} for this parameter (yet)",
                         where="safe_set_full_optimizer_state",
                         hint="set optimizer states after the first step(); keys are the "
                              "optimizer's own (Adam: exp_avg, exp_avg_sq)")
    return value
