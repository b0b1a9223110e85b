"""Mixture of Experts as a data-parallel strategy: one strategy over the dense parameters
and the whole data-parallel group, one per expert group over its expert-data-parallel
group, presented to the engine as one.

Every part is a plain stage 0 or ZeRO strategy of the configured stage (:mod:`.stage0`,
:class:`~deepshard.runtime.zero.runtime.ZeroStrategy`): dense gradients are reduced over
the data-parallel group, an expert's over the ranks holding a replica of it (its edp
group), and its ZeRO shards are cut over those ranks. The engine scales every loss by
``1 / dp_world``, so the sum over the edp group is the expert's gradient of pure data
parallelism (its tokens come from every rank of the ep group through the all-to-all): the
same math at every ``ep_size`` and stage.

The one optimizer holds every part's param groups (a group is dense or of one expert group
only, :mod:`deepshard.runtime.assembly.moe`); each part sees only its own groups and their
state (:func:`narrowed`), so stepping, saving and restoring go through the parts' own code.

The gradient norm counts every parameter once: each part's squared norm summed over the
ranks its shards are cut over, an expert part's then over its expert-parallel group (the
ranks holding the other experts).

Checkpoints keep expert parameters under their global names (``...deepspeed_experts.
{global id}...``: the parts are built with those names), in the rank files: stage 0
expert parts write whole entries from the first rank of each edp group, ZeRO ones their
shards. So a checkpoint reads back by name at any ``ep_size`` or world size, and
consolidates to one state dict holding every expert.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from deepshard.comm import collectives as comm
from deepshard.runtime.checkpoint.by_name import Needed, copy_scalars, merge_groups
from deepshard.runtime.precision import global_norm
from deepshard.runtime.strategy.base import DataParallelStrategy
from deepshard.runtime.strategy.stage0 import Stage0Strategy


@dataclass(frozen=True)
class Part:
    """One sub-strategy of :class:`MoEStrategy` and what it owns.

    Attributes:
        name: ``"dense"`` or the expert group's name (``ep_size_{E}``).
        strategy: the stage 0 or ZeRO strategy over its parameters (experts: named by
            their global names).
        opt_groups: indices of the optimizer param groups holding its parameters.
        local_names: the module's state-dict names of its parameters.
        ep_group: experts: the expert-parallel group (``None``: dense, or ``ep_size`` 1).
        ep_world: its size (1 for the dense part).
        edp_rank: this rank's index in the part's data-parallel group.
        all_names: experts: the global names of every expert of the group, on every rank.
    """

    name: str
    strategy: DataParallelStrategy
    opt_groups: tuple[int, ...]
    local_names: tuple[str, ...]
    ep_group: dist.ProcessGroup | None = None
    ep_world: int = 1
    edp_rank: int = 0
    all_names: frozenset[str] = frozenset()
    steps: frozenset[int] = frozenset()
    """The ids of the tensors it steps: a param group may hold several parts' (a client
    optimizer over dense and expert parameters in one group)."""

    def narrow(self, optimizer: torch.optim.Optimizer | None):
        """:func:`narrowed` to this part's groups and tensors."""
        return narrowed(optimizer, self.opt_groups, self.steps or None)

    @property
    def whole(self) -> bool:
        """Its parameters are whole on every rank (stage 0): checkpointed here."""
        return isinstance(self.strategy, Stage0Strategy)


@contextlib.contextmanager
def narrowed(optimizer: torch.optim.Optimizer | None, indices: Sequence[int],
             tensors: frozenset[int] | None = None
             ) -> Iterator[torch.optim.Optimizer | None]:
    """``optimizer`` showing only its param groups ``indices`` and their state for the
    block (``step``, ``state_dict`` and ``load_state_dict`` then see only those); what
    the block changed (new state, groups replaced by ``load_state_dict``) is kept. With
    ``tensors`` (ids), a group holding other tensors too is shown with only those; the
    block's hyperparameters go back into the whole group."""
    if optimizer is None:
        yield None
        return
    groups, state = optimizer.param_groups, optimizer.state

    def shown(g: dict) -> dict:
        if tensors is None or all(id(p) in tensors for p in g["params"]):
            return g
        return {**g, "params": [p for p in g["params"] if id(p) in tensors]}

    presented = [shown(groups[i]) for i in indices]
    ids = {id(p) for g in presented for p in g["params"]}
    optimizer.param_groups = presented
    optimizer.state = defaultdict(dict, {p: s for p, s in state.items() if id(p) in ids})
    try:
        yield optimizer
    finally:
        for i, before, g in zip(indices, presented, optimizer.param_groups, strict=True):
            if before is groups[i]:
                groups[i] = g
            else:  # a part of a shared group: its hyperparameters only
                groups[i].update({k: v for k, v in g.items() if k != "params"})
        mine = optimizer.state
        for p in [p for p in state if id(p) in ids]:
            del state[p]
        state.update(mine)
        optimizer.param_groups, optimizer.state = groups, state


class MoEStrategy(DataParallelStrategy):
    """The dense part and the expert parts (see the module docstring), in that order
    (expert parts sorted by name: every rank calls their collectives in one order)."""

    def __init__(self, dense: Part, experts: Sequence[Part],
                 group: dist.ProcessGroup | None, world: int):
        self.parts = (dense, *experts)
        self.stage = dense.strategy.stage
        self.params = tuple(p for part in self.parts for p in part.strategy.params)
        self.names = tuple(n for part in self.parts for n in part.strategy.names)
        self.group, self.world = group, world
        self._counts = [0] * len(self.parts)

    # -- backward ---------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        for part in self.parts:
            part.strategy.begin_backward(boundary)

    def begin_passive(self) -> None:
        for part in self.parts:
            part.strategy.begin_passive()

    def end_backward(self, boundary: bool) -> None:
        for part in self.parts:
            part.strategy.end_backward(boundary)

    def abort_backward(self) -> None:
        for part in self.parts:
            part.strategy.abort_backward()

    def reduce_now(self) -> None:
        for part in self.parts:
            part.strategy.reduce_now()

    # -- the step ---------------------------------------------------------------------
    def unscaled_grads(self, inv_scale: float) -> list[torch.Tensor]:
        lists = [part.strategy.unscaled_grads(inv_scale) for part in self.parts]
        self._counts = [len(grads) for grads in lists]
        return [g for grads in lists for g in grads]

    def _split(self, grads: Sequence[torch.Tensor]) -> list[Sequence[torch.Tensor]]:
        out, start = [], 0
        for n in self._counts:
            out.append(grads[start:start + n])
            start += n
        return out

    def apply_step(self, optimizer: torch.optim.Optimizer) -> None:
        for part in self.parts:
            with part.narrow(optimizer) as mine:
                part.strategy.apply_step(mine)

    def zero_grad(self) -> None:
        for part in self.parts:
            part.strategy.zero_grad()

    def excluded_grads(self, grads: Sequence[torch.Tensor],
                       excluded: frozenset[int]) -> list[torch.Tensor]:
        return [g for part, gs in zip(self.parts, self._split(grads), strict=True)
                for g in part.strategy.excluded_grads(gs, excluded)]

    def gradient_norm(self, grads: Sequence[torch.Tensor], excluded: frozenset[int],
                      mp_group: dist.ProcessGroup | None) -> torch.Tensor:
        total = None
        for part, gs in zip(self.parts, self._split(grads), strict=True):
            sq = global_norm(gs).square()
            parts = part.strategy.excluded_grads(gs, excluded) if excluded else []
            if parts:
                sq = sq - global_norm(parts).square()
            part.strategy.sum_over_data_parallel_(sq)  # its shards (ZeRO)
            if part.ep_world > 1:  # the other experts
                comm.all_reduce(sq, group=part.ep_group)
            total = sq if total is None else total + sq.to(total.device)
        assert total is not None
        if mp_group is not None:
            dist.all_reduce(total, group=mp_group)
        return total.clamp_min(0).sqrt()

    def owner_of(self, param: torch.Tensor) -> DataParallelStrategy:
        """The part's strategy that trains ``param`` (what ``safe_get_full_*`` ask: an
        expert's whole tensors come from its expert-data-parallel group's shards); the
        dense part's for a parameter none trains (it says so)."""
        for part in self.parts:
            if any(p is param for p in part.strategy.params):
                return part.strategy
        return self.parts[0].strategy

    # -- accounting and lifetime -------------------------------------------------------
    def state_bytes(self, module, optimizer) -> dict[str, int]:
        """The parts' bytes added up (the dense part counts the module's parameters at
        stage 0, where every part's are whole)."""
        out = {"params": 0, "grads": 0, "optimizer": 0, "nvme": 0}
        for part in self.parts:
            with part.narrow(optimizer) as mine:
                held = part.strategy.state_bytes(
                    module if part is self.parts[0] else torch.nn.Module(), mine)
            for key in out:
                out[key] += held[key]
        return out

    def close(self) -> None:
        for part in self.parts:
            part.strategy.close()

    # -- checkpoints ------------------------------------------------------------------
    @property
    def master_dtype(self) -> str | None:
        return next((d for d in (p.strategy.master_dtype for p in self.parts) if d), None)

    @contextlib.contextmanager
    def materialized(self, optimizer) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                with part.narrow(optimizer) as mine:
                    stack.enter_context(part.strategy.materialized(mine))
            yield

    def owned_names(self, module: torch.nn.Module) -> set[str]:
        owned = self.parts[0].strategy.owned_names(module)
        for part in self.parts[1:]:
            owned |= set(part.local_names)
        return owned

    def entry_names(self) -> set[str]:
        """Every expert's global name on every rank: names a checkpoint holds that this
        rank's module lacks, and that are not unexpected."""
        return {n for part in self.parts[1:] for n in part.all_names}

    def masters_by_name(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        return self.parts[0].strategy.masters_by_name(module)

    def optimizer_state(self, optimizer) -> dict | None:
        """The dense part's (stage 0: its state by position), with every param group's
        hyperparameters."""
        if optimizer is None:
            return None
        dense = self.parts[0]
        with dense.narrow(optimizer) as mine:
            state = dense.strategy.optimizer_state(mine)
        return {**(state or {}), "param_groups": optimizer.state_dict()["param_groups"]}

    def optimizer_names(self, optimizer) -> list[str] | None:
        dense = self.parts[0]
        with dense.narrow(optimizer) as mine:
            return dense.strategy.optimizer_names(mine)

    def rank_payload(self, optimizer, exclude_frozen: bool = False) -> list[dict]:
        out: list[dict] = []
        for part in self.parts:
            with part.narrow(optimizer) as mine:
                if part is not self.parts[0] and part.whole:
                    if part.edp_rank == 0:  # the others hold the same replicas
                        out.extend(whole_entries(cast(Stage0Strategy, part.strategy), mine))
                else:
                    out.extend(part.strategy.rank_payload(mine, exclude_frozen) or [])
        return out

    def needed(self) -> Needed | None:
        values: set[str] = set()
        state: set[str] = set()
        for part in self.parts:
            need = part.strategy.needed() if not part.whole else \
                Needed(frozenset(part.strategy.names), frozenset(part.strategy.names))
            if need is None or (part is self.parts[0] and part.whole):
                return None  # stage 0's dense part takes everything
            values |= need.values
            state |= need.state
        return Needed(frozenset(values), frozenset(state))

    def restore(self, optimizer, by_name, load_optimizer: bool,
                saved_groups: list[dict]) -> set[str]:
        full = optimizer is not None and len(saved_groups) == len(optimizer.param_groups)
        missing: set[str] = set()
        for part in self.parts:
            saved = [saved_groups[i] for i in part.opt_groups] if full else []
            with part.narrow(optimizer) as mine:
                if part is not self.parts[0] and part.whole:
                    missing |= restore_whole(part.strategy, mine, by_name, load_optimizer,
                                             saved)
                else:
                    missing |= part.strategy.restore(mine, by_name, load_optimizer, saved)
        return missing


def _step_tensors(strategy: Stage0Strategy) -> Sequence[torch.Tensor]:
    return strategy.masters.masters if strategy.masters is not None else strategy.params


def whole_entries(strategy: Stage0Strategy, optimizer) -> list[dict]:
    """Rank-file entries (:mod:`..checkpoint.zero_shards`' form, one whole parameter
    each) of a stage 0 strategy's parameters, by its names."""
    out = []
    for name, p, t in zip(strategy.names, strategy.params, _step_tensors(strategy),
                          strict=True):
        state = optimizer.state.get(t, {}) if optimizer is not None else {}
        n = p.numel()
        out.append({
            "names": [name], "offsets": [0], "numels": [n], "shapes": [tuple(p.shape)],
            "lo": 0, "hi": n, "values": t.detach().float().reshape(-1).clone(),
            "state": {k: v.detach().reshape(-1).clone() for k, v in state.items()
                      if torch.is_tensor(v) and v.dim() > 0},
            "scalars": {k: v for k, v in state.items()
                        if not (torch.is_tensor(v) and v.dim() > 0)},
        })
    return out


@torch.no_grad()
def restore_whole(strategy: Stage0Strategy, optimizer, by_name, load_optimizer: bool,
                  saved_groups: list[dict]) -> set[str]:
    """Take a stage 0 strategy's parameters (and masters, and optimizer state when asked)
    from a checkpoint's by-name form; returns the names it lacked."""
    missing = set()
    for name, p, t in zip(strategy.names, strategy.params, _step_tensors(strategy),
                          strict=True):
        if name not in by_name.present:
            missing.add(name)
            continue
        if name in by_name.values:
            value = by_name.values[name]
            p.copy_(value.view_as(p))
            if t is not p:
                t.copy_(value.view_as(t))
        if load_optimizer and optimizer is not None and name in by_name.state:
            optimizer.state[t] = {**copy_scalars(by_name.scalars.get(name, {})),
                                  **{k: v.view_as(t).clone()
                                     for k, v in by_name.state[name].items()}}
    if load_optimizer and optimizer is not None:
        for g, saved in zip(optimizer.param_groups,
                            merge_groups(optimizer.param_groups, saved_groups), strict=True):
            g.update({k: v for k, v in saved.items() if k != "params"})
    return missing
