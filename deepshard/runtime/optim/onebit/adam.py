"""1-bit Adam (https://arxiv.org/abs/2102.02888) with DeepSpeed ``OnebitAdam``'s update.

Adam's variance becomes stable early in training; 1-bit Adam runs ``freeze_step`` steps of
plain Adam on the all-reduced gradient, then freezes the variance and all-reduces the
momentum instead of the gradient, compressed to one bit per element with error feedback
(:mod:`.compressed`): 1/32 of the traffic. The engine asks :meth:`OneBitAdam.communicates_next_step`
before each step whether to all-reduce the gradients itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from deepshard.comm.process_group import is_initialized
from deepshard.runtime.optim.base import StepOptimizer
from deepshard.runtime.optim.onebit.compressed import CompressedAllreduce
from deepshard.runtime.optim.onebit.flat import keep_current_masks

__all__ = ["OneBitAdam", "OnebitAdam"]

_BACKENDS = ("nccl", "mpi", "hccl", "compressed", "gloo")


class OneBitAdam(StepOptimizer):
    """1-bit Adam, with the update of DeepSpeed's ``OnebitAdam``.

    For each parameter ``p`` with gradient ``g`` at step ``t`` (counted from 1):

    * warm-up, ``t <= freeze_step``: ``g`` is the data-parallel average (the engine
      all-reduced it); ``m = beta1 m + (1 - beta1) g``, ``v = beta2 v + (1 - beta2) g^2``;
    * compressed, ``t > freeze_step``: ``g`` is this rank's local gradient;
      ``m = beta1 m + (1 - beta1) g``, then ``m`` = the compressed all-reduce (average) of
      ``m`` over the group, all parameters' momenta as one flat buffer, one call per step;
      ``m *= exp_avg_mask`` where the param group has one; ``v`` stays frozen;
    * both: ``u = m / (sqrt(v) + eps)``, ``u += weight_decay * p`` when ``weight_decay > 0``,
      ``p -= lr * u``.

    As in DeepSpeed, there is no bias correction (``bias_correction`` is kept in the param
    groups but does not change the update), ``eps`` is always outside the square root
    (``eps_inside_sqrt``, ``max_grad_norm``, ``cuda_aware`` and ``comm_backend_name`` are
    accepted for configs' sake; communication goes through :mod:`deepshard.comm` on the
    group's backend), and a parameter whose ``grad`` is ``None`` is not updated (its
    momentum still takes part in the all-reduce). Unlike DeepSpeed, the first step is a real
    Adam step (DeepSpeed's first call only allocates its buffers and discards the gradient);
    the switch to compression comes after the same ``freeze_step`` steps.

    State per parameter (``state_dict``: what every rank shares): ``step`` (int),
    ``exp_avg`` (a view into one flat fp32 buffer of all momenta), ``exp_avg_sq`` (fp32).
    The compression errors are per rank, outside ``state``: :meth:`error_state` and
    :meth:`load_error_state`.

    Args:
        params: tensors, or param-group dicts, to optimise; a group may carry
            ``exp_avg_mask``: one tensor applied to each of its parameters (broadcast, as
            DeepSpeed does), or a list of them, one per parameter.
        deepspeed: the engine (its ``mpu``'s data-parallel group is used when ``group`` is
            not given).
        lr, betas, eps, weight_decay: as in Adam (weight decay added to the update).
        freeze_step: the number of warm-up steps of uncompressed Adam.
        amsgrad: not supported; ``True`` raises ``ValueError``.
        group: the data-parallel process group; ``None``: the default group.
    """

    def __init__(self, params: Iterable[Any], deepspeed: Any = None, lr: float = 1e-3,
                 freeze_step: int = 100000, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", *, group: Any = None):
        _check_arguments(lr, freeze_step, betas, eps, weight_decay, amsgrad, comm_backend_name)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.deepspeed = deepspeed
        self.freeze_step = freeze_step
        self.eps_inside_sqrt = eps_inside_sqrt
        self.cuda_aware = cuda_aware
        self.comm_backend_name = comm_backend_name
        self.group = group if group is not None else _mpu_group(deepspeed)
        self.last_bytes_sent = 0
        """Bytes this rank sent in the last step's compressed all-reduce (0 in warm-up)."""
        self.comm_bytes = 0
        """Running total of :attr:`last_bytes_sent`."""
        self._allreduce: CompressedAllreduce | None = None
        self._flat: torch.Tensor | None = None
        self._errors: tuple[torch.Tensor, torch.Tensor] | None = None
        self._denoms: dict[torch.Tensor, tuple[float, torch.Tensor]] = {}
        self._work: torch.Tensor | None = None

    # ---- the engine protocol ------------------------------------------------------------

    def communicates_next_step(self) -> bool:
        """Whether the coming :meth:`step` all-reduces (compressed) by itself: then the
        engine must not all-reduce the gradients and hands this rank's local ones (the
        local average of its micro-batches). True once ``freeze_step`` steps are done."""
        return self.steps_done() >= self.freeze_step

    def steps_done(self) -> int:
        """The number of steps taken (the parameters' ``step``; 0 before the first)."""
        return max((s.get("step", 0) for s in self.state.values()), default=0)

    def error_state(self) -> dict[str, torch.Tensor]:
        """This rank's compression errors (``worker_error``, ``server_error``), for its
        own checkpoint shard; empty before the first compressed step."""
        if self._errors is None:
            return {}
        return {"worker_error": self._errors[0], "server_error": self._errors[1]}

    def load_error_state(self, errors: dict[str, torch.Tensor] | None) -> None:
        """Take errors saved by :meth:`error_state` (call it after ``load_state_dict``,
        which resets them). ``None``, an empty dict or sizes that do not fit this world
        size and model reset them to zero."""
        self._errors = None
        if not errors or not self._build_flat():
            return
        flat = self._flat
        assert flat is not None  # _build_flat() made it
        worker, server = errors.get("worker_error"), errors.get("server_error")
        fresh = self._reducer().new_errors(flat.numel(), flat.device)
        if worker is None or server is None or worker.shape != fresh[0].shape \
                or server.shape != fresh[1].shape:
            return
        fresh[0].copy_(worker)
        fresh[1].copy_(server)
        self._errors = fresh

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict``, keeping this optimizer's ``exp_avg_mask`` (as DeepSpeed:
        masks come from the training script, not the checkpoint); the flat momentum buffer
        is rebuilt from the loaded ``exp_avg`` and the compression errors are reset."""
        super().load_state_dict(keep_current_masks(self.param_groups, state_dict))
        self._denoms.clear()
        self._flat = None
        self._errors = None
        if self.state:
            self._build_flat()

    # ---- the step -----------------------------------------------------------------------

    def _take_step(self) -> None:
        """One step (class docstring); communicates when :meth:`communicates_next_step`."""
        compressed = self.communicates_next_step()
        self._build_flat()
        self._update_moments(compressed)
        self.last_bytes_sent = 0
        if compressed:
            self._allreduce_momentum()
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["step"] += 1
                if p.grad is not None:
                    self.update_parameter(p, group, frozen=compressed)

    def update_parameter(self, p: torch.Tensor, group: dict[str, Any], frozen: bool) -> None:
        """``p -= lr * (exp_avg / (sqrt(exp_avg_sq) + eps) + weight_decay * p)`` from
        ``p``'s state (``frozen``: the variance no longer changes, its denominator is kept);
        also ZeRO stage 1's update of its shards (:mod:`deepshard.runtime.zero.onebit`)."""
        state = self.state[p]
        _apply_update(p, state, group, self._denominator(p, state, group["eps"], frozen),
                      self._scratch(p))

    def _scratch(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two fp32 work buffers shaped like ``p``, views of two kept as large as the
        largest parameter (no allocation, no page faults, in a step)."""
        n = max(q.numel() for q in self._params())
        kept = self._work
        if kept is None or kept.shape[1] < n or kept.device != p.device:
            kept = self._work = torch.empty(2, n, dtype=torch.float32, device=p.device)
        return kept[0, :p.numel()].view(p.shape), kept[1, :p.numel()].view(p.shape)

    def _denominator(self, p: torch.Tensor, state: dict[str, Any], eps: float,
                     frozen: bool) -> torch.Tensor:
        """``sqrt(exp_avg_sq) + eps``; once the variance is frozen, computed once and kept
        (4 bytes a parameter: two passes over memory fewer a step)."""
        if not frozen:
            return state["exp_avg_sq"].sqrt() + eps
        kept = self._denoms.get(p)
        if kept is None or kept[0] != eps:
            kept = self._denoms[p] = (eps, state["exp_avg_sq"].sqrt() + eps)
        return kept[1]

    def _update_moments(self, compressed: bool) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("1-bit Adam does not support sparse gradients")
                state, grad = self.state[p], p.grad.reshape(p.shape)
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                if not compressed:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    def _allreduce_momentum(self) -> None:
        reducer = self._reducer()
        if reducer.world > 1:
            flat = self._flat
            assert flat is not None
            flat[self._numel():].zero_()  # padding enters every call as zeros (DeepSpeed)
            if self._errors is None:
                self._errors = reducer.new_errors(self._numel(), flat.device)
            reducer(flat, *self._errors)
            self.last_bytes_sent = reducer.last_bytes_sent
            self.comm_bytes += reducer.last_bytes_sent
        for group in self.param_groups:
            if "exp_avg_mask" in group:
                _apply_mask(group, self.state)

    # ---- buffers ------------------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _numel(self) -> int:
        return sum(p.numel() for p in self._params())

    def _reducer(self) -> CompressedAllreduce:
        if self._allreduce is None:
            if not is_initialized():
                raise ValueError("1-bit Adam needs the process group: call "
                                 "deepshard.init_distributed() before its first step")
            self._allreduce = CompressedAllreduce(self.group)
        return self._allreduce

    def _build_flat(self) -> bool:
        """Make every parameter's state, its ``exp_avg`` a view into one flat fp32 buffer
        (kept from loaded or earlier ``exp_avg``); False when there are no parameters."""
        params = self._params()
        if not params:
            return False
        if self._flat is not None and all(
                self.state[p].get("exp_avg") is not None for p in params):
            return True  # (a param group added since then gets a new buffer, errors reset)
        self._errors = None
        device = params[0].device
        if any(p.device != device for p in params):
            raise ValueError("1-bit Adam keeps all momenta in one buffer: put every "
                             "parameter on one device")
        flat = torch.zeros(self._reducer().padded_numel(self._numel()), dtype=torch.float32,
                           device=device)
        offset = 0
        for p in params:
            state = self.state[p]
            view = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
            if "exp_avg" in state:
                view.copy_(state["exp_avg"])
            state.setdefault("step", 0)
            state["exp_avg"] = view
            sq = state.get("exp_avg_sq")
            state["exp_avg_sq"] = (torch.zeros_like(p, dtype=torch.float32) if sq is None
                                   else sq.to(device=device, dtype=torch.float32).clone())
        self._flat = flat
        return True


OnebitAdam = OneBitAdam
"""DeepSpeed's spelling (``deepspeed.runtime.fp16.onebit.adam.OnebitAdam``)."""


def _apply_update(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
                  denominator: torch.Tensor,
                  work: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``p -= lr * (m / denominator + weight_decay * p)``, rounded as those operations
    are, in the ``work`` buffers."""
    update = torch.div(state["exp_avg"], denominator, out=work[0])
    if group["weight_decay"] > 0.0:
        update += torch.mul(p, group["weight_decay"], out=work[1])
    p.add_(update.to(p.dtype), alpha=-group["lr"])


def _apply_mask(group: dict[str, Any], state: Any) -> None:
    masks = group["exp_avg_mask"]
    params = group["params"]
    if isinstance(masks, torch.Tensor):
        masks = [masks] * len(params)
    if len(masks) != len(params):
        raise ValueError(f"exp_avg_mask: {len(masks)} masks for a param group of "
                         f"{len(params)} parameters; give one tensor, or one per parameter")
    for p, mask in zip(params, masks, strict=True):
        exp_avg = state[p]["exp_avg"]
        exp_avg.mul_(mask.to(exp_avg.device))


def _mpu_group(deepspeed: Any) -> Any:
    mpu = getattr(deepspeed, "mpu", None)
    getter = getattr(mpu, "get_data_parallel_group", None)
    return getter() if callable(getter) else None


def _check_arguments(lr: float, freeze_step: int, betas: tuple[float, float], eps: float,
                     weight_decay: float, amsgrad: bool, comm_backend_name: str) -> None:
    if amsgrad:
        raise ValueError("1-bit Adam does not support the AMSGrad variant: set amsgrad=False")
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"1-bit Adam: lr must be a finite number >= 0, got {lr}")
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 0:
        raise ValueError(f"1-bit Adam: freeze_step must be an integer >= 0, got {freeze_step!r}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"1-bit Adam: betas must be two numbers in [0, 1), got {betas}")
    if not eps >= 0 or not weight_decay >= 0:
        raise ValueError(f"1-bit Adam: eps and weight_decay must be >= 0, got {eps}, "
                         f"{weight_decay}")
    if comm_backend_name not in _BACKENDS:
        raise ValueError(f"1-bit Adam: comm_backend_name {comm_backend_name!r} is not one of "
                         f"{', '.join(_BACKENDS)}")
