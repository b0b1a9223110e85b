"""Tied weights across pipeline stages: which ranks share them, and keeping them equal.

A :class:`~.pipe_module.TiedLayerSpec` key used on several stages (say the embedding on
the first and the output projection on the last) has one replica per stage. Replicas
start equal (:meth:`TiedWeightGroups.broadcast_weights` from the first holding stage)
and stay equal because, after every backward, each replica's gradient is replaced by
the sum of all replicas' gradients (:meth:`TiedWeightGroups.all_reduce_grads`): each
stage computed the gradient of its own use of the weight, and the true gradient is the
sum. Identical gradients and identical optimizer states give identical updates.

:func:`tied_rank_groups` is the plan (pure); :class:`TiedWeightGroups` creates the groups
(a collective: every rank calls it) and runs the collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deepshard.comm.teardown import keep
from deepshard.runtime.parallel.topology import Topology

if TYPE_CHECKING:
    from deepshard.runtime.parallel.pipe_module import PipelineModule

__all__ = ["TiedWeightGroups", "tied_rank_groups"]


def tied_rank_groups(tied: Mapping[str, tuple[int, ...]],
                     topology: Topology) -> dict[str, tuple[tuple[int, ...], ...]]:
    """For each tied key held by two stages or more: the groups of global ranks whose
    replicas must agree, one per (data, tensor) coordinate, each in stage order.

    ``tied`` is :meth:`PipelineModule.tied_groups` (key -> holding stages). The order of
    the result (sorted keys, then data-major, tensor-minor) is the order in which every
    rank must create the groups."""
    groups = {}
    for key in sorted(tied):
        stages = tied[key]
        if len(stages) < 2:
            continue
        groups[key] = tuple(
            tuple(topology.rank(s, d, t) for s in stages)
            for d in range(topology.data) for t in range(topology.tensor))
    return groups


@dataclass(frozen=True)
class TiedWeightGroups:
    """This rank's tied-weight groups: for each tied key it shares with other stages,
    the ranks holding the replicas and the process group over them."""

    ranks: Mapping[str, tuple[int, ...]]
    groups: Mapping[str, Any]

    @classmethod
    def create(cls, module: PipelineModule, topology: Topology, rank: int | None = None,
               new_group: Callable[[list[int]], Any] | None = None) -> TiedWeightGroups:
        """Create the groups of :func:`tied_rank_groups` (every rank must call this; it
        creates all groups, in that order) and keep this rank's."""
        import torch.distributed as dist

        rank = dist.get_rank() if rank is None else rank
        new_group = new_group or dist.new_group
        ranks, groups = {}, {}
        for key, rank_groups in tied_rank_groups(module.tied_groups(), topology).items():
            for members in rank_groups:
                group = new_group(list(members))
                keep(group)  # never destructed: see comm/teardown.py
                if rank in members:
                    ranks[key], groups[key] = members, group
        return cls(ranks, groups)

    def broadcast_weights(self, module: PipelineModule) -> None:
        """Copy the first holding stage's replica of every shared tied weight to the
        others (once, after building, or after loading a checkpoint)."""
        import torch.distributed as dist

        weights = module.tied_weights()
        with torch.no_grad():
            for key in sorted(self.groups):
                for weight in weights[key]:
                    dist.broadcast(weight.data, src=self.ranks[key][0], group=self.groups[key])

    def all_reduce_grads(self, module: PipelineModule) -> None:
        """Sum every shared tied weight's gradient over its replicas (after the last
        backward of a batch, before the data-parallel reduction and the step). A replica
        with no gradient contributes zeros."""
        import torch.distributed as dist

        weights = module.tied_weights()
        for key in sorted(self.groups):
            for weight in weights[key]:
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight)
                dist.all_reduce(weight.grad, group=self.groups[key])

    def duplicates(self, module: PipelineModule, rank: int) -> tuple[torch.nn.Parameter, ...]:
        """The tied parameters that are replicas on ``rank`` (not on the first holding
        stage): leave them out when summing a global gradient norm over stages, so that
        each tied weight counts once."""
        weights = module.tied_weights()
        return tuple(w for key in sorted(self.groups) if self.ranks[key][0] != rank
                     for w in weights[key])
