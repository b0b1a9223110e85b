"""ZeRO stage 1 with 1-bit Adam: the optimizer state stays sharded, and once the variance
freezes each rank's momentum reaches the rank that owns it compressed to one bit.

Warm-up (``freeze_step`` steps) is plain stage 1 and :class:`OneBitAdam`'s Adam step on the
shards. Then, per flat group, every rank keeps a *local momentum* over the whole padded
buffer, ``m_i = beta1 m_i + (1 - beta1) g_i`` of its own gradient ``g_i`` (started from the
averaged momentum when compression begins; the mean of the ``m_i`` is then exactly the
momentum of the averaged gradients), adds its worker error, and compresses chunk ``r`` —
rank ``r``'s shard — to signs and one RMS scale; one all-to-all hands every owner its
chunk from everyone, whose average is the shard's momentum (``exp_avg``). The owner
updates its shard with the frozen variance (``OneBitAdam.update_parameter``) and
ZeRO's parameter all-gather follows as at every stage-1 step. Unlike stage 0 there is no
server phase: the average stays with the rank that steps it. A step moves one bit per
element through the all-to-all instead of the gradient's reduce-scatter.

Each rank's local momentum and worker error go into its own checkpoint file; at another
world size they start again from the averaged momentum and zero (one log line).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import cast

import torch
import torch.distributed as dist

from deepshard.comm import collectives as comm
from deepshard.runtime.optim.onebit.compressed import compress_rows, decompress_rows
from deepshard.runtime.strategy.compressed import LocalGradients
from deepshard.runtime.zero.runtime import ZeroStrategy
from deepshard.runtime.zero.stage1 import Stage1Grads

logger = logging.getLogger("deepshard")


@dataclass(eq=False)
class OneBitZeroStrategy(LocalGradients, ZeroStrategy):
    """ZeRO stage 1 whose gradient reduction becomes 1-bit momentum exchange (module
    docstring) while ``optimizer.communicates_next_step()``."""

    optimizer: torch.optim.Optimizer | None = None
    local: list[torch.Tensor] | None = None  # per flat group: this rank's momentum
    errors: list[torch.Tensor] | None = None  # per flat group: its worker error
    _local_grads: list[torch.Tensor] = field(default_factory=list)  # the step's, fp32

    @classmethod
    def over(cls, zero: ZeroStrategy, optimizer: torch.optim.Optimizer) -> OneBitZeroStrategy:
        """``zero`` (stage 1) driving ``optimizer`` (a :class:`OneBitAdam`)."""
        for group in optimizer.param_groups:
            if "exp_avg_mask" in group:
                raise ValueError("exp_avg_mask is not supported at ZeRO stage 1 (a shard "
                                 "holds pieces of many parameters): use stage 0")
        return cls(**{f.name: getattr(zero, f.name) for f in fields(ZeroStrategy)},
                   optimizer=optimizer)

    def gradient_buckets(self) -> Stage1Grads:
        return cast(Stage1Grads, self.grads)  # stage 1's

    # -- the step ---------------------------------------------------------------------
    def unscaled_grads(self, inv_scale: float) -> list[torch.Tensor]:
        if not self.local_step():
            return super().unscaled_grads(inv_scale)
        self.grads.unreduced = False  # local by design
        factor = float(self.world) * inv_scale  # the loss carried 1 / world
        buffers = cast(Stage1Grads, self.grads).buffers
        if all(b.dtype == torch.float32 for b in buffers):
            torch._foreach_mul_(buffers, factor)
            self._local_grads = buffers
        else:  # fp16/bf16 gradients: the loss scale undone in fp32 (a transient copy)
            self._local_grads = [b.float().mul_(factor) for b in buffers]
        return self._local_grads

    def apply_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.local_step():
            return super().apply_step(optimizer)
        if self.local is None:
            self._start_local()
        for k, grad in enumerate(self._local_grads):
            self._step_group(k, grad, self.stepper.step_tensors[k])
        self._local_grads = []
        self.stepper.update_model()

    def _start_local(self) -> None:
        """Local momenta := the averaged one (all shards gathered once); errors := 0."""
        self.local, self.errors = [], []
        assert self.optimizer is not None  # set by over()
        for k, g in enumerate(self.groups):
            shard = self.optimizer.state[self.stepper.step_tensors[k]]["exp_avg"]
            full = torch.empty(g.spec.padded, dtype=torch.float32, device=shard.device)
            comm.all_gather_into_tensor(full, shard.reshape(-1).contiguous(), group=self.group)
            self.local.append(full)
            self.errors.append(torch.zeros_like(full))

    def _step_group(self, k: int, grad: torch.Tensor, t: torch.Tensor) -> None:
        # set by over() and _start_local()
        assert self.optimizer is not None and self.local is not None and self.errors is not None
        opt_group = next(pg for pg in self.optimizer.param_groups
                         if any(p is t for p in pg["params"]))
        beta1 = opt_group["betas"][0]
        m = self.local[k].mul_(beta1).add_(grad, alpha=1 - beta1)
        state = self.optimizer.state[t]
        numel = self.groups[k].spec.numel
        state["exp_avg"].copy_(self._exchange(m, self.errors[k], numel)
                               .view_as(state["exp_avg"]))
        state["step"] += 1
        self.optimizer.update_parameter(t, opt_group, frozen=True)

    def _exchange(self, m: torch.Tensor, error: torch.Tensor, numel: int) -> torch.Tensor:
        """This rank's shard of the mean over ranks of ``m + error``, sent compressed;
        ``error`` becomes this rank's compression error (none kept for the padding past
        ``numel``: it enters every exchange as zeros)."""
        shard = m.numel() // self.world
        cols = -(-shard // 8) * 8
        x = torch.zeros(self.world, cols, dtype=torch.float32, device=m.device)
        x[:, :shard] = (m + error).view(self.world, shard)
        wire, _ = compress_rows(x)
        error.view(self.world, shard).copy_(x[:, :shard] - decompress_rows(wire)[:, :shard])
        error[numel:].zero_()
        received = torch.empty_like(wire)
        comm.all_to_all_single(received, wire, group=self.group)
        return decompress_rows(received).mean(0)[:shard]

    def state_bytes(self, module, optimizer) -> dict[str, int]:
        """ZeRO's, plus the local momenta and worker errors once compression began."""
        held = super().state_bytes(module, optimizer)
        extra = [*(self.local or ()), *(self.errors or ())]
        held["optimizer"] += sum(t.numel() * t.element_size() for t in extra)
        return held

    # -- checkpoints ------------------------------------------------------------------
    def own_state(self, optimizer) -> dict | None:
        if self.local is None:
            return None
        return {"onebit_local": self.local, "onebit_errors": self.errors, "world": self.world}

    def restore_own(self, optimizer, payload: object | None, saved_world: int) -> None:
        assert self.optimizer is not None  # set by over()
        self.optimizer.load_state_dict(self.optimizer.state_dict())  # its flat momentum
        self.local = self.errors = None
        if not isinstance(payload, dict) or "onebit_local" not in payload:
            return
        if saved_world != self.world:
            if dist.get_rank(self.group) == 0:
                logger.info("1-bit Adam: the checkpoint was saved by %d ranks, this job has "
                            "%d: local momenta restart from the averaged one, errors from "
                            "zero", saved_world, self.world)
            return
        self.local = [t.clone() for t in payload["onebit_local"]]
        self.errors = [t.clone() for t in payload["onebit_errors"]]
