"""Stage 0 as a data-parallel strategy: every rank holds everything; gradients are
averaged by the bucketed all-reduce of :mod:`..buckets`, overlapped with backward; with
fp16/bf16 the optimizer steps the fp32 masters of :mod:`..precision`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from deepshard.runtime.buckets import GradBuckets
from deepshard.runtime.checkpoint.by_name import merge_groups, stage0_optimizer_state
from deepshard.runtime.precision import MasterWeights, global_norm
from deepshard.runtime.strategy.base import DataParallelStrategy


class Stage0Strategy(DataParallelStrategy):
    """Plain data parallelism over ``buckets`` (and ``masters`` for half precision)."""

    stage = 0

    def __init__(self, buckets: GradBuckets, masters: MasterWeights | None,
                 names: Sequence[str]):
        self.buckets, self.masters = buckets, masters
        self.params = tuple(buckets.params)
        self.names = tuple(names)
        self.group, self.world = buckets.group, buckets.world

    # -- backward ---------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        self.buckets.begin_backward(boundary)

    def end_backward(self, boundary: bool) -> None:
        self.buckets.end_backward()
        if boundary:
            self.buckets.finish()

    def abort_backward(self) -> None:
        self.buckets.end_backward()

    def reduce_now(self) -> None:
        self.buckets.reduce_all()

    # -- the step ---------------------------------------------------------------------
    def unscaled_grads(self, inv_scale: float) -> list[torch.Tensor]:
        if self.buckets.unreduced:
            self.buckets.reduce_all()
        if self.masters is None:
            return self.buckets.buffers
        self.masters.load_grads(self.buckets.buffers, inv_scale)
        return self.masters.grad_flats

    def apply_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        if self.masters is not None:
            self.masters.copy_to_model()

    def zero_grad(self) -> None:
        self.buckets.zero()

    def excluded_grads(self, grads: Sequence[torch.Tensor],
                       excluded: frozenset[int]) -> list[torch.Tensor]:
        views = self.masters.grad_views if self.masters is not None else self.buckets.views
        return [v for p, v in zip(self.params, views, strict=True) if id(p) in excluded]

    def gradient_norm(self, grads: Sequence[torch.Tensor], excluded: frozenset[int],
                      mp_group: dist.ProcessGroup | None) -> torch.Tensor:
        if mp_group is None:  # every rank holds the same reduced gradients
            return global_norm(grads)
        return super().gradient_norm(grads, excluded, mp_group)

    # -- accounting -------------------------------------------------------------------
    def state_bytes(self, module, optimizer) -> dict[str, int]:
        params = sum(t.numel() * t.element_size() for t in module.parameters())
        held = 0
        if optimizer is not None:
            for state in optimizer.state.values():
                held += sum(v.numel() * v.element_size() for v in state.values()
                            if torch.is_tensor(v))
        if self.masters is not None:
            master_params, master_grads = self.masters.nbytes()
            held += master_params + master_grads
        return {"params": params, "grads": self.buckets.nbytes(), "optimizer": held,
                "nvme": 0}

    def close(self) -> None:
        self.buckets.remove()

    # -- checkpoints ------------------------------------------------------------------
    @property
    def master_dtype(self) -> str | None:
        return "torch.float32" if self.masters is not None else None

    def owned_names(self, module: torch.nn.Module) -> set[str]:
        return set()

    def masters_by_name(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """fp32 masters keyed by every name of their parameter (tied weights: all aliases)."""
        if self.masters is None:
            return None
        by_id = self.masters.master_of()
        return {name: by_id[id(p)].detach().clone()
                for name, p in module.named_parameters(remove_duplicate=False)
                if id(p) in by_id}

    def optimizer_state(self, optimizer) -> dict | None:
        return optimizer.state_dict() if optimizer is not None else None

    def optimizer_names(self, optimizer) -> list[str]:
        if optimizer is None:
            return []
        tensors = self.masters.masters if self.masters is not None else self.params
        by_id = {id(t): n for t, n in zip(tensors, self.names, strict=True)}
        return [by_id.get(id(p), "") for g in optimizer.param_groups for p in g["params"]]

    def rank_payload(self, optimizer, exclude_frozen: bool = False) -> None:
        return None

    @torch.no_grad()
    def restore(self, optimizer, by_name, load_optimizer: bool,
                saved_groups: list[dict]) -> set[str]:
        if self.masters is not None:
            for name, m in zip(self.names, self.masters.masters, strict=True):
                if name in by_name.values:
                    m.copy_(by_name.values[name].view_as(m))
        if load_optimizer and optimizer is not None:
            groups = merge_groups(optimizer.state_dict()["param_groups"], saved_groups)
            optimizer.load_state_dict(stage0_optimizer_state(
                by_name, self.optimizer_names(optimizer), groups))
        return set()
