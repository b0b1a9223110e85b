"""0/1 Adam (https://arxiv.org/abs/2202.06009) with DeepSpeed ``ZeroOneAdam``'s update rules.

DeepSpeed removed its 1-bit optimizers; configs naming ``ZeroOneAdam`` must still train the
same way here. Differences from DeepSpeed's code are in the plumbing, not the arithmetic: all
parameters travel in ONE flat padded fp32 buffer per step (one compressed all-reduce per step,
where DeepSpeed made one per parameter), the optimizer does its own uncompressed all-reduce at
variance-update steps (DeepSpeed toggled the engine's), and per-rank buffers live outside
``self.state``. :class:`~.flat.FlatParams` (the flat layout) is shared with 1-bit LAMB.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepshard.runtime.optim.base import StepOptimizer
from deepshard.runtime.optim.onebit.flat import (
    DEEPSPEED_INIT_STEPS,
    FlatParams,
    apply_masks,
    check_common,
    keep_current_masks,
    restore_errors,
    ring_allreduce_bytes,
)


@dataclass
class ZeroOneSchedule:
    """0/1 Adam's two policies, on DeepSpeed's step counter ``t`` (see
    :data:`DEEPSPEED_INIT_STEPS`).

    * Variance: while not frozen, step ``t`` updates the variance (with an uncompressed
      all-reduce of the gradient) when ``t % var_interval == 0``; every such step counts, and
      after ``var_update_scaler`` of them ``var_interval`` doubles. After a step with
      ``t > var_freeze_step`` the variance is frozen for good.
    * Local steps (frozen only): step ``t`` synchronises when ``t % local_step_interval == 0``;
      every frozen step counts, and after ``local_step_scaler`` of them the interval doubles,
      up to ``local_step_clipper``.
    """

    var_interval: int = 1
    var_counter: int = 0
    local_step_interval: int = 1
    local_step_counter: int = 0

    def variance_step(self, t: int) -> bool:
        return t % self.var_interval == 0

    def sync_step(self, t: int) -> bool:
        return t % self.local_step_interval == 0

    def advance(self, t: int, frozen: bool, opt: ZeroOneAdam) -> None:
        """The counters after step ``t`` (DeepSpeed's end-of-step bookkeeping)."""
        if not frozen:
            if t % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == opt.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
        else:
            self.local_step_counter += 1
            if self.local_step_counter == opt.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(opt.local_step_clipper,
                                               self.local_step_interval * 2)

    def as_dict(self) -> dict[str, int]:
        return dict(var_interval=self.var_interval, var_counter=self.var_counter,
                    local_step_interval=self.local_step_interval,
                    local_step_counter=self.local_step_counter)


class ZeroOneAdam(StepOptimizer):
    """0/1 Adam as DeepSpeed's ``ZeroOneAdam`` computes it, on a torch.distributed group.

    With ``t = step + 1`` (DeepSpeed's counter, see :data:`DEEPSPEED_INIT_STEPS`), ``g`` this
    rank's gradient, ``C(x)`` the compressed average over ranks with error feedback
    (:class:`~deepshard.runtime.optim.onebit.compressed.CompressedAllreduce`), ``A(x)`` the
    exact average, ``d = sqrt(v) + eps`` and ``upd = m / d + weight_decay * p``:

    * variance phase, updates ``k <= max(var_freeze_step, 1)`` (DeepSpeed freezes after the
      step whose counter passes ``var_freeze_step``), see :class:`ZeroOneSchedule`: at
      variance steps ``g = A(g)`` (done by step() itself; DeepSpeed had its engine do it),
      ``v = b2 v + (1-b2) g^2``, ``m = b1 m + (1-b1) g``; at the others
      ``m = b1 m + (1-b1) mask * C(g)``; then ``p -= lr * upd``.
    * frozen phase (the errors are zeroed on entry): ``m = b1 m + (1-b1) g`` locally,
      ``lrs += lr``, ``p -= lr * upd``, ``u -= lr * upd``; at sync steps ``p -= u``,
      ``u = mask * C(u * d)``, ``m = -u / lrs``, ``p += u / d``, then ``u = 0``, ``lrs = 0``.

    No bias correction; ``bias_correction``, ``eps_inside_sqrt``, ``max_grad_norm``,
    ``cuda_aware``, ``comm_backend_name`` and ``deepspeed`` are accepted for DeepSpeed's
    configs and ignored, as there. A parameter without a gradient counts as a zero gradient.
    On one rank no compression happens (the average of one buffer is itself).

    Where this differs from DeepSpeed's code: the compressed all-reduce sees one flat buffer
    of all parameters (DeepSpeed compressed each parameter on its own, so its scales were per
    parameter); on one rank ``m`` takes the gradient at compressed steps (DeepSpeed's skipped
    the update there); ``m = 0`` when ``lrs`` is 0 (DeepSpeed divided by zero); a checkpoint
    keeps the schedule counters (DeepSpeed reset them to their initial values on load).

    **Parameters across ranks.** In the variance phase, and in the frozen phase after each
    sync step, every rank holds the same ``m``, ``v`` and parameters (up to rounding: ``p - u``
    restores the synchronised value only to within an ulp, as in DeepSpeed). Between syncs
    (frozen phase, ``local_step_interval > 1``) each rank's parameters and ``exp_avg`` follow
    its own gradients: :meth:`params_in_sync` says which is the case after the last step.

    **Checkpoints.** The local accumulation since the last sync (``u``, ``lrs``) is per rank
    and never checkpointed: :meth:`load_state_dict` resets it (as DeepSpeed does), so a
    checkpoint of rank 0's parameters and ``state_dict()`` taken between syncs resumes with
    rank 0's local parameters and momentum as every rank's synchronised starting point (the
    ranks stay identical; the other ranks' local steps since the last sync are dropped). At a
    sync point (``params_in_sync()``) a resume continues exactly.

    Engine protocol: :meth:`communicates_next_step` is always True (step() does all of its own
    communication and wants this rank's local average gradient); ``state_dict()`` holds
    ``step``, ``exp_avg``, ``exp_avg_sq`` and the schedule counters per parameter, the same
    on every rank except ``exp_avg`` between syncs (see above: rank 0's is then the one to
    save); :meth:`error_state` / :meth:`load_error_state` carry the per-rank
    compression errors (``worker_error``, ``server_error``);
    :attr:`last_bytes_sent` is what this rank sent in its last step. ``amsgrad=True`` is a
    ``ValueError``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        deepspeed: Any = None,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        check_common(lr, betas, eps, weight_decay, amsgrad, "0/1 Adam")
        for name, value in (("var_update_scaler", var_update_scaler),
                            ("local_step_scaler", local_step_scaler),
                            ("local_step_clipper", local_step_clipper)):
            if int(value) < 1:
                raise ValueError(f"0/1 Adam: {name} must be >= 1, got {value}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.deepspeed = deepspeed
        self.eps_inside_sqrt = eps_inside_sqrt
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)
        self.cuda_aware = cuda_aware
        self.comm_backend_name = comm_backend_name
        self.group = group
        self.last_bytes_sent = 0
        self._flat: FlatParams | None = None
        self._local: dict[str, torch.Tensor] = {}
        self._in_sync = True

    # ---- the engine protocol ----

    def communicates_next_step(self) -> bool:
        """Always True: every step does its own (compressed or exact) all-reduce."""
        return True

    def params_in_sync(self) -> bool:
        """Whether every rank held the same parameters after the last step (False only
        between the syncs of the frozen phase)."""
        return self._in_sync

    def error_state(self) -> dict[str, torch.Tensor]:
        """This rank's compression errors (``worker_error``, ``server_error``)."""
        self._ensure_built()
        return dict(self._local)

    def load_error_state(self, errors: dict[str, torch.Tensor] | None) -> None:
        """Restore :meth:`error_state`'s buffers; None, or a missing or mismatched entry,
        resets them to zeros."""
        self._ensure_built()
        restore_errors(self._local, errors)

    # ---- state ----

    def _ensure_built(self) -> FlatParams:
        """The flat layout, built (with the buffers and errors) on first use."""
        if self._flat is not None:
            return self._flat
        from deepshard.runtime.optim.onebit.compressed import CompressedAllreduce

        self._comm = CompressedAllreduce(group=self.group)
        self._world = dist.get_world_size(self.group)
        flat = FlatParams(self.param_groups, self._comm.padded_numel)
        states = [self.state[p] for _, p, _ in flat.entries]
        for state in states:
            state.setdefault("step", 0)
            for key, value in ZeroOneSchedule().as_dict().items():
                state.setdefault(key, value)
        self._m, self._v = flat.zeros(), flat.zeros()
        flat.attach(states, "exp_avg", self._m)
        flat.attach(states, "exp_avg_sq", self._v)
        self._buffer = flat.zeros()
        worker, server = self._comm.new_errors(flat.padded, flat.device)
        self._local = {"worker_error": worker, "server_error": server}
        # u (the momentum_accumulator of DeepSpeed) and the sum of lrs since the last sync
        self._accumulated = {"u": flat.zeros(),
                             "lrs": torch.zeros(len(self.param_groups), dtype=torch.float64)}
        self._frozen_denom: torch.Tensor | None = None
        self._flat = flat
        return flat

    @property
    def _layout(self) -> FlatParams:
        """The flat layout of a built optimizer (every step builds it first)."""
        assert self._flat is not None, "_ensure_built() first"
        return self._flat

    def _first_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.state[self._layout.entries[0][1]]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load shared state (the script's ``exp_avg_mask`` wins over the checkpoint's, as in
        DeepSpeed) and rebuild the flat buffers from it; the per-rank buffers are reset (the
        errors can be loaded with :meth:`load_error_state`; the local accumulation since the
        last sync starts again from zero, see the class docstring)."""
        super().load_state_dict(keep_current_masks(self.param_groups, state_dict))
        self._flat = None
        self._ensure_built()
        self._in_sync = True

    # ---- the step ----

    def frozen(self, k: int) -> bool:
        """Whether update number ``k`` (1-based) runs with the variance frozen: DeepSpeed
        freezes after a step whose counter exceeds ``var_freeze_step`` (never after its
        initialization step)."""
        return k > max(self.var_freeze_step, DEEPSPEED_INIT_STEPS)

    def _take_step(self) -> None:
        """One 0/1 Adam update (see the class docstring)."""
        flat, first = self._ensure_built(), self._first_state()
        k = first["step"] + 1
        t = k + DEEPSPEED_INIT_STEPS
        schedule = ZeroOneSchedule(**{key: first[key] for key in ZeroOneSchedule().as_dict()})
        frozen = self.frozen(k)
        grads = flat.gather_grads(self._buffer)
        self.last_bytes_sent = 0
        if not frozen:
            self._variance_phase(grads, schedule.variance_step(t))
            self._in_sync = True
        else:
            if not self.frozen(k - 1):  # DeepSpeed zeroes the errors on entering this phase
                self._local["worker_error"].zero_()
                self._local["server_error"].zero_()
            self._frozen_phase(grads, schedule.sync_step(t))
        schedule.advance(t, frozen, self)
        for _, p, _ in flat.entries:
            self.state[p].update(step=k, **schedule.as_dict())

    def _compressed(self, buffer: torch.Tensor) -> None:
        """``buffer`` becomes the compressed average over ranks (nothing on one rank)."""
        if self._world > 1:
            self._comm(buffer, self._local["worker_error"], self._local["server_error"])
            self.last_bytes_sent += self._comm.last_bytes_sent

    def _variance_phase(self, grads: torch.Tensor, variance_step: bool) -> None:
        flat = self._layout
        if variance_step:
            if self._world > 1:
                used = grads[:flat.numel]
                dist.all_reduce(used, group=self.group)
                used.div_(self._world)
                self.last_bytes_sent += ring_allreduce_bytes(flat.numel, self._world)
        else:
            self._compressed(grads)
            apply_masks(flat, grads, self.param_groups)
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            g = flat.group_slice(grads, index)
            if variance_step:
                flat.group_slice(self._v, index).mul_(beta2).addcmul_(g, g, value=1 - beta2)
            flat.group_slice(self._m, index).mul_(beta1).add_(g, alpha=1 - beta1)
        self._apply_updates(None)

    def _denominators(self) -> torch.Tensor:
        """``sqrt(v) + eps``, flat, with each group's eps (padding: 1)."""
        denom = self._v.sqrt()
        denom[self._layout.numel:] = 1.0
        for index, group in enumerate(self.param_groups):
            self._layout.group_slice(denom, index).add_(group["eps"])
        return denom

    def _frozen_denominators(self) -> torch.Tensor:
        """:meth:`_denominators` of the frozen variance, computed once (and again after a
        load)."""
        if self._frozen_denom is None:
            self._frozen_denom = self._denominators()
        return self._frozen_denom

    def _apply_updates(self, accumulator: torch.Tensor | None,
                       denom: torch.Tensor | None = None) -> None:
        """``p -= lr * upd`` for every parameter (and ``u -= lr * upd`` into
        ``accumulator``), ``upd = m / (sqrt(v) + eps) + weight_decay * p``."""
        flat = self._layout
        update = self._m / (self._denominators() if denom is None else denom)
        for i, (index, p, _) in enumerate(flat.entries):
            group = self.param_groups[index]
            view = flat.view(update, i)
            if group["weight_decay"] > 0.0:
                view.add_(group["weight_decay"] * p.detach().float())
            view.mul_(-group["lr"])
            p.add_(view.to(p.dtype))
        if accumulator is not None:
            accumulator[:flat.numel].add_(update[:flat.numel])

    def _frozen_phase(self, grads: torch.Tensor, sync: bool) -> None:
        flat, u, lrs = self._layout, self._accumulated["u"], self._accumulated["lrs"]
        for index, group in enumerate(self.param_groups):
            beta1 = group["betas"][0]
            m = flat.group_slice(self._m, index)
            m.mul_(beta1).add_(flat.group_slice(grads, index), alpha=1 - beta1)
            lrs[index] += group["lr"]
        denom = self._frozen_denominators()
        self._apply_updates(u, denom)
        self._in_sync = sync
        if not sync:
            return
        for i, (_, p, _) in enumerate(flat.entries):
            p.sub_(flat.view(u, i).to(p.dtype))
        u.mul_(denom)
        self._compressed(u)
        apply_masks(flat, u, self.param_groups)
        for index in range(len(self.param_groups)):
            total = float(lrs[index])
            m = flat.group_slice(self._m, index)
            if total > 0:
                torch.div(flat.group_slice(u, index), -total, out=m)
            else:  # lr 0 throughout the interval: DeepSpeed would divide by zero
                m.zero_()
        u.div_(denom)
        for i, (_, p, _) in enumerate(flat.entries):
            p.add_(flat.view(u, i).to(p.dtype))
        u.zero_()
        lrs.zero_()
