"""1-bit LAMB (https://arxiv.org/abs/2104.06069) with DeepSpeed ``OnebitLamb``'s update rules.

DeepSpeed removed its 1-bit optimizers; configs naming ``OneBitLamb`` must still train the
same way here. As in DeepSpeed, every parameter's momentum lives in one flat padded buffer,
compressed and all-reduced once per step after the warm-up; per-rank compression errors live
outside ``self.state``. The flat layout is :class:`~.flat.FlatParams`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
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
)

__all__ = ["OneBitLamb", "OnebitLamb", "norm", "trust_ratio"]


def norm(x: torch.Tensor) -> float:
    """The 2-norm as DeepSpeed computes it (``x.pow(2).sum().sqrt()``)."""
    return float(x.pow(2).sum().sqrt())


def trust_ratio(weight_norm: float, update_norm: float, max_coeff: float,
                min_coeff: float) -> float:
    """LAMB's coefficient ``||p|| / ||upd||`` clamped to ``[min_coeff, max_coeff]``, or 1
    when either norm is 0."""
    if weight_norm == 0 or update_norm == 0:
        return 1.0
    return min(max(weight_norm / update_norm, min_coeff), max_coeff)


class OneBitLamb(StepOptimizer):
    """1-bit LAMB as DeepSpeed's ``OnebitLamb`` computes it, on a torch.distributed group.

    With ``t = step + 1`` (DeepSpeed's counter, see
    :data:`~.flat.DEEPSPEED_INIT_STEPS`), per parameter, ``d = sqrt(v) + eps``:

    * warm-up, the first ``max(freeze_step - 1, 1)`` updates, on the data-parallel average
      gradient ``g``: ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2`` (at ``t ==
      freeze_step``, the last warm-up step, ``v_fresh = v``); ``upd = m / d +
      weight_decay * p``; ``c = clamp(||p|| / ||upd||, min_coeff, max_coeff)`` (1 if a norm is
      0); when ``c != 1``, ``c_freeze = coeff_beta c_freeze + (1 - coeff_beta) c``;
      ``p -= lr * c * upd``.
    * compression, on this rank's local gradient ``g``: at its first step each parameter gets
      ``s = mean_q(rms(m_q)) / rms(m)`` (1 when ``rms(m)`` is 0). ``m_old = m``; ``m = (b1 m +
      (1-b1) g) * s``; all momenta, flat, are compressed and averaged over ranks with error
      feedback; ``m = mask * m / s``; ``g' = (m - b1 m_old) / (1-b1)``, ``v_fresh = b2 v_fresh +
      (1-b2) g'^2``; ``upd = m / d + weight_decay * p`` (``v`` frozen); ``f = max(d /
      (sqrt(v_fresh) + eps))``, with weight decay ``f = f r + 1 - r`` where ``r = min(1,
      ||m / d|| / ||upd||)``; ``f`` clamped to ``[factor_min, factor_max]`` and then to
      ``last_factor * (1 -+ factor_threshold)``; ``last_factor = f``; ``p -= lr * c_freeze * f
      * upd``.

    No bias correction; ``bias_correction``, ``eps_inside_sqrt``, ``max_grad_norm``,
    ``cuda_aware``, ``comm_backend_name`` and ``deepspeed`` are accepted for DeepSpeed's
    configs and ignored, as there. A parameter without a gradient counts as a zero gradient.
    On one rank nothing is compressed (as in DeepSpeed). Parameters and all of ``state`` stay
    identical across ranks at every step (the compressed average is the same on every rank).

    Where DeepSpeed's code had accidents this does not copy them: the flat buffer's padding is
    zero at every all-reduce (DeepSpeed's kept the previous result), a zero momentum gets
    ``s = 1`` (DeepSpeed's divided by zero), ``v_fresh = v`` also when ``freeze_step < 2``
    (DeepSpeed's stayed zero), and a checkpoint loads ``lamb_coeff_freeze``, ``last_factor``
    and ``scaling_coeff`` as saved (DeepSpeed reset them when loading a warm-up checkpoint).

    Engine protocol: :meth:`communicates_next_step` is False during the warm-up (the engine
    all-reduces and step() gets the data-parallel average) and True afterwards (step() gets
    this rank's local average gradient and does one compressed all-reduce); ``state_dict()``
    holds only shared state; :meth:`error_state` / :meth:`load_error_state` carry the
    per-rank ``worker_error`` and ``server_error``; :attr:`last_bytes_sent` is what this rank
    sent in its last step; :meth:`get_lamb_coeffs` the last step's coefficients, as in
    DeepSpeed. ``amsgrad=True`` is a ``ValueError``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        deepspeed: Any = None,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        check_common(lr, betas, eps, weight_decay, amsgrad, "1-bit LAMB")
        if not 0.0 <= coeff_beta <= 1.0:
            raise ValueError(f"1-bit LAMB: coeff_beta must be in [0, 1], got {coeff_beta}")
        if not (0 <= min_coeff <= max_coeff and 0 <= factor_min <= factor_max
                and factor_threshold >= 0):
            raise ValueError("1-bit LAMB: need 0 <= min_coeff <= max_coeff, 0 <= factor_min <= "
                             f"factor_max and factor_threshold >= 0, got {min_coeff}, "
                             f"{max_coeff}, {factor_min}, {factor_max}, {factor_threshold}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.deepspeed = deepspeed
        self.freeze_step = int(freeze_step)
        self.eps_inside_sqrt = eps_inside_sqrt
        self.cuda_aware = cuda_aware
        self.comm_backend_name = comm_backend_name
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
        self.group = group
        self.last_bytes_sent = 0
        self.lamb_coeffs: list[float] = []
        self._flat: FlatParams | None = None
        self._local: dict[str, torch.Tensor] = {}

    # ---- the engine protocol ----

    def warmup_steps(self) -> int:
        """How many updates run uncompressed: DeepSpeed's counter reaches ``freeze_step``
        at update ``freeze_step - 1``, and at least one warm-up update always runs."""
        return max(self.freeze_step - DEEPSPEED_INIT_STEPS, 1)

    def _done(self) -> int:
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.state and "step" in self.state[p]:
                    step: int = self.state[p]["step"]
                    return step
        return 0

    def communicates_next_step(self) -> bool:
        """True once the warm-up is over: the coming step() all-reduces (compressed) itself."""
        return self._done() >= self.warmup_steps()

    def error_state(self) -> dict[str, torch.Tensor]:
        """This rank's compression errors (``worker_error``, ``server_error``)."""
        self._ensure_built()
        return dict(self._local)

    def load_error_state(self, errors: dict[str, torch.Tensor] | None) -> None:
        """Restore :meth:`error_state`'s buffers; None, or a missing or mismatched entry,
        resets them to zeros."""
        self._ensure_built()
        restore_errors(self._local, errors)

    def get_lamb_coeffs(self) -> list[float]:
        """The LAMB coefficients of the last step, one per parameter (DeepSpeed's API)."""
        return self.lamb_coeffs

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
            state.setdefault("lamb_coeff_freeze", 0.0)
            state.setdefault("last_factor", 1.0)
        self._m, self._v, self._fresh = flat.zeros(), flat.zeros(), flat.zeros()
        flat.attach(states, "exp_avg", self._m)
        flat.attach(states, "exp_avg_sq", self._v)
        flat.attach(states, "exp_avg_sq_fresh", self._fresh)
        self._buffer = flat.zeros()
        worker, server = self._comm.new_errors(flat.padded, flat.device)
        self._local = {"worker_error": worker, "server_error": server}
        self._flat = flat
        return flat

    @property
    def _layout(self) -> FlatParams:
        """The flat layout of a built optimizer (every step builds it first)."""
        assert self._flat is not None, "_ensure_built() first"
        return self._flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load shared state (the script's ``exp_avg_mask`` wins over the checkpoint's, as in
        DeepSpeed) and rebuild the flat buffers from it; the per-rank errors are reset (load
        them with :meth:`load_error_state`)."""
        super().load_state_dict(keep_current_masks(self.param_groups, state_dict))
        self._flat = None
        self._ensure_built()

    # ---- the step ----

    def _take_step(self) -> None:
        """One 1-bit LAMB update (see the class docstring)."""
        flat = self._ensure_built()
        k = self._done() + 1
        grads = flat.gather_grads(self._buffer)
        self.lamb_coeffs = []
        self.last_bytes_sent = 0
        if k <= self.warmup_steps():
            self._warmup(grads, last=k == self.warmup_steps())
        else:
            self._compression(grads)
        for _, p, _ in flat.entries:
            self.state[p]["step"] = k

    def _warmup(self, grads: torch.Tensor, last: bool) -> None:
        flat = self._layout
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            g = flat.group_slice(grads, index)
            flat.group_slice(self._m, index).mul_(beta1).add_(g, alpha=1 - beta1)
            flat.group_slice(self._v, index).mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if last:
            self._fresh.copy_(self._v)
        for i, (index, p, _) in enumerate(flat.entries):
            group, state = self.param_groups[index], self.state[p]
            update = flat.view(self._m, i) / (flat.view(self._v, i).sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update.add_(group["weight_decay"] * p.detach().float())
            coeff = trust_ratio(norm(p.detach().float()), norm(update),
                                group["max_coeff"], group["min_coeff"])
            if coeff != 1.0:
                state["lamb_coeff_freeze"] = (self.coeff_beta * state["lamb_coeff_freeze"]
                                              + (1 - self.coeff_beta) * coeff)
            self.lamb_coeffs.append(coeff)
            p.add_((update * (-group["lr"] * coeff)).to(p.dtype))

    def _scaling_coeffs(self) -> list[float]:
        """Each momentum's ``scaling_coeff``, computed once at the first compressed step from
        the warm-up's momenta: the mean RMS over all momenta divided by this one's."""
        flat = self._layout
        states = [self.state[p] for _, p, _ in flat.entries]
        if "scaling_coeff" not in states[0]:
            scales = [float(torch.linalg.vector_norm(flat.view(self._m, i)))
                      / math.sqrt(p.numel())
                      for i, (_, p, _) in enumerate(flat.entries)]
            united = sum(scales) / len(scales)
            for state, scale in zip(states, scales, strict=True):
                state["scaling_coeff"] = united / scale if scale > 0 else 1.0
        return [state["scaling_coeff"] for state in states]

    def _compression(self, grads: torch.Tensor) -> None:
        flat = self._layout
        coeffs = self._scaling_coeffs()
        m_old = self._m.clone()
        for index, group in enumerate(self.param_groups):
            beta1 = group["betas"][0]
            flat.group_slice(self._m, index).mul_(beta1).add_(
                flat.group_slice(grads, index), alpha=1 - beta1)
        for i, coeff in enumerate(coeffs):
            flat.view(self._m, i).mul_(coeff)
        if self._world > 1:
            self._m[flat.numel:] = 0.0
            self._comm(self._m, self._local["worker_error"], self._local["server_error"])
            self.last_bytes_sent = self._comm.last_bytes_sent
            self._m[flat.numel:] = 0.0
        for i, coeff in enumerate(coeffs):
            flat.view(self._m, i).div_(coeff)
        apply_masks(flat, self._m, self.param_groups)
        for i in range(len(flat.entries)):
            self._compressed_update(i, m_old)

    def _compressed_update(self, i: int, m_old: torch.Tensor) -> None:
        """The frozen-variance LAMB update of entry ``i`` once its momentum is averaged."""
        flat = self._layout
        index, p, _ = flat.entries[i]
        group, state = self.param_groups[index], self.state[p]
        beta1, beta2 = group["betas"]
        m, fresh = flat.view(self._m, i), flat.view(self._fresh, i)
        rebuilt = (m - flat.view(m_old, i) * beta1) / (1 - beta1)
        fresh.mul_(beta2).addcmul_(rebuilt, rebuilt, value=1 - beta2)
        denom = flat.view(self._v, i).sqrt() + group["eps"]
        prelim = m / denom
        update = prelim + group["weight_decay"] * p.detach().float() \
            if group["weight_decay"] > 0.0 else prelim
        factor = float((denom / (fresh.sqrt() + group["eps"])).max())
        if group["weight_decay"] > 0.0:
            ratio = min(1.0, float(prelim.pow(2).sum().sqrt() / update.pow(2).sum().sqrt()))
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.factor_min), self.factor_max)
        last = state["last_factor"]
        factor = min(factor, last * (1.0 + self.factor_threshold))
        factor = max(factor, last * (1.0 - self.factor_threshold))
        state["last_factor"] = factor
        coeff = state["lamb_coeff_freeze"] * factor
        self.lamb_coeffs.append(coeff)
        p.add_((update * (-group["lr"] * coeff)).to(p.dtype))


OnebitLamb = OneBitLamb
"""DeepSpeed's spelling (``deepspeed.runtime.fp16.onebit.lamb.OnebitLamb``)."""
