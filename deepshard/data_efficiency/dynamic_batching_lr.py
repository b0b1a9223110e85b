"""Dynamic batching, the learning rate: any scheduler's value scaled to each batch's size.

A batch of dynamic batching holds a varying number of sequences, so the learning rate of
step ``t`` is the wrapped scheduler's (or the optimizer's constant) learning rate for step
``t``, scaled by ``batch_sizes[t]`` over the base batch size (:func:`scale_lr`). The values
are DeepSpeed 0.19.8's ``VariableBatchSizeLR``'s; its state also holds the wrapped
scheduler's, so that a resume continues exactly.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from deepshard.data_efficiency.dynamic_batching_plan import lr_scaling_method_name, scale_lr
from deepshard.errors import UsageError, UsageValueError

logger = logging.getLogger(__name__)

# what torch says when a scheduler is set to a step (what a reset does, on purpose)
_RESET_WARNINGS = (r"The epoch parameter in `scheduler\.step\(\)`",
                   r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")


class VariableBatchSizeLR(LRScheduler):
    """Scale the learning rate of ``lr_scheduler`` by the size of each batch.

    After ``step()`` ``t`` the optimizer's learning rates are the wrapped scheduler's for its
    step ``t``, scaled by ``scale_lr(base_batch_size, batch_sizes[t % len(batch_sizes)])``.
    Construction resets the wrapped scheduler to step 0 (as DeepSpeed's does), and so does
    ``step(0)``: DeepSpeed's examples call it at the start of every epoch. Build it before
    loading a checkpoint into it.

    Unlike DeepSpeed's, :meth:`get_last_lr` is the learning rate in effect (the scaled one,
    what torch's schedulers return and what monitors log); :meth:`get_unscaled_lr` is the
    wrapped scheduler's.

    Args:
        lr_scheduler: the scheduler to scale: anything with ``optimizer`` and
            ``step(epoch=None)``, torch's and deepshard's; ``ReduceLROnPlateau`` is refused.
        base_batch_size: the batch size the wrapped learning rate is meant for.
        batch_sizes: the sequences in each batch of the epoch (:class:`BatchPlan`'s).
        dataloader: kept for DeepSpeed's signature; not used.
        lr_scaling_method: ``linear``, ``sqrt`` or ``none``.
        last_epoch: kept for DeepSpeed's signature; construction sets step 0.
        verbose: log each step's batch size and learning rates.
    """

    def __init__(self, lr_scheduler: Any, base_batch_size: int, batch_sizes: Sequence[int],
                 dataloader: Any = None, lr_scaling_method: str | None = "linear",
                 last_epoch: int = -1, verbose: bool = False) -> None:
        # torch's LRScheduler.__init__ is not called (nor is it by DeepSpeed): this one
        # computes nothing from the optimizer, it drives `lr_scheduler`
        _check_scheduler(lr_scheduler)
        self.base_lr_scheduler = lr_scheduler
        self.base_batch_size = _positive(base_batch_size, "base_batch_size")
        self.batch_sizes = [_positive(size, "batch_sizes") for size in batch_sizes]
        if not self.batch_sizes:
            raise UsageError("no batch sizes to scale by", where="batch_sizes")
        self.lr_scaling_method = lr_scaling_method_name(lr_scaling_method, "lr_scaling_method")
        self.dataloader = dataloader
        self.verbose = verbose
        self.base_lrs = _initial_lrs(lr_scheduler)
        if getattr(lr_scheduler, "last_epoch", 0) > 0:
            logger.warning("dynamic batching: the learning-rate scheduler, at step %d, is reset "
                           "to step 0; build dynamic batching before loading a checkpoint",
                           lr_scheduler.last_epoch)
        self.last_epoch = last_epoch
        self._unscaled_lrs = list(self.base_lrs)
        self._last_lr = list(self.base_lrs)
        self.step(0)

    @property
    def optimizer(self) -> Any:
        """The wrapped scheduler's optimizer."""
        return self.base_lr_scheduler.optimizer

    @property
    def batch_size(self) -> int:
        """Sequences in the batch whose learning rate is in effect."""
        return self.batch_sizes[self.last_epoch % len(self.batch_sizes)]

    def step(self, epoch: int | None = None) -> None:
        """Advance the wrapped scheduler one step (or set it to step ``epoch``; ``0`` resets
        it to its initial learning rates) and apply its learning rate scaled to the batch
        of that step."""
        # the wrapped scheduler steps from its own, unscaled values (chainable schedulers
        # such as StepLR read the optimizer's current ones)
        _set_lrs(self.optimizer, self.base_lrs if epoch == 0 else self._unscaled_lrs)
        if epoch is None:
            self.base_lr_scheduler.step()
            self.last_epoch += 1
        else:
            with warnings.catch_warnings():
                for message in _RESET_WARNINGS:
                    warnings.filterwarnings("ignore", message=message)
                self.base_lr_scheduler.step(epoch)
            self.last_epoch = epoch
        self._unscaled_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self._apply()
        if self.verbose:
            logger.info("dynamic batching: step %d, batch of %d sequences (base %d): lr %s "
                        "scaled to %s", self.last_epoch, self.batch_size, self.base_batch_size,
                        self._unscaled_lrs, self._last_lr)

    def get_last_lr(self) -> list[float]:
        """The learning rates in effect: the wrapped scheduler's, scaled."""
        return list(self._last_lr)

    def get_lr(self) -> list[float]:
        """The optimizer's learning rates (DeepSpeed's ``get_lr``)."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_unscaled_lr(self) -> list[float]:
        """The wrapped scheduler's learning rates for the current step, before scaling."""
        return list(self._unscaled_lrs)

    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's keys (the wrapped scheduler's state under ``base_lr_scheduler``), and
        the unscaled learning rates in effect."""
        return {"base_lr_scheduler": self.base_lr_scheduler.state_dict(),
                "base_batch_size": self.base_batch_size,
                "lr_scaling_method": self.lr_scaling_method,
                "batch_sizes": list(self.batch_sizes), "base_lrs": list(self.base_lrs),
                "last_epoch": self.last_epoch, "verbose": self.verbose,
                "unscaled_lrs": list(self._unscaled_lrs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` (ours or DeepSpeed's) and apply its learning rates
        to the optimizer.

        The step reached and the wrapped scheduler's state come from ``state_dict``; the
        batch sizes and the scaling stay those this scheduler was built with, which describe
        the batches its loader delivers (DeepSpeed takes the saved ones): a difference is
        logged. The state of the wrapped scheduler alone (a run without dynamic batching)
        loads too, and continues at its step.
        """
        if "base_lr_scheduler" not in state_dict:
            self.base_lr_scheduler.load_state_dict(state_dict)
            self.last_epoch = max(int(getattr(self.base_lr_scheduler, "last_epoch", 0)), 0)
            self._unscaled_lrs = [float(lr) for lr in self.base_lr_scheduler.get_last_lr()]
            self._apply()
            return
        self.base_lr_scheduler.load_state_dict(state_dict["base_lr_scheduler"])
        saved = {"batch_sizes": list(state_dict.get("batch_sizes", self.batch_sizes)),
                 "base_batch_size": state_dict.get("base_batch_size", self.base_batch_size),
                 "lr_scaling_method": lr_scaling_method_name(
                     state_dict.get("lr_scaling_method", self.lr_scaling_method))}
        changed = [key for key, value in saved.items() if getattr(self, key) != value]
        if changed:
            logger.warning("dynamic batching: the learning-rate state loaded was saved with "
                           "another %s; going on with this run's (that of its batches)",
                           " and ".join(changed))
        self.base_lrs = [float(lr) for lr in state_dict["base_lrs"]]
        self.last_epoch = int(state_dict["last_epoch"])
        self.verbose = bool(state_dict.get("verbose", self.verbose))
        unscaled = state_dict.get("unscaled_lrs")
        if unscaled is None:  # DeepSpeed's state: the wrapped scheduler's last values
            unscaled = self.base_lr_scheduler.get_last_lr()
        self._unscaled_lrs = [float(lr) for lr in unscaled]
        self._apply()

    def _apply(self) -> None:
        """Set the optimizer's learning rates to the unscaled ones scaled to this batch."""
        size = self.batch_size
        self._last_lr = [scale_lr(self.base_batch_size, size, lr, self.lr_scaling_method)
                         for lr in self._unscaled_lrs]
        _set_lrs(self.optimizer, self._last_lr)


class ConstantLR:
    """The optimizer's learning rates, kept: what :class:`VariableBatchSizeLR` scales when
    there is no scheduler (DeepSpeed's ``StubLRScheduler``)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.last_epoch = 0

    def step(self, epoch: int | None = None) -> None:
        """Set the optimizer's learning rates back to their initial values."""
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        _set_lrs(self.optimizer, self.base_lrs)

    def get_last_lr(self) -> list[float]:
        """The constant learning rates."""
        return list(self.base_lrs)

    def state_dict(self) -> dict[str, Any]:
        """The learning rates and the step reached."""
        return {"base_lrs": list(self.base_lrs), "last_epoch": self.last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values."""
        self.base_lrs = [float(lr) for lr in state_dict["base_lrs"]]
        self.last_epoch = int(state_dict["last_epoch"])


def lr_scheduler_for_variable_batch_size(base_batch_size: int, batch_sizes: Sequence[int],
                                         dataloader: Any, lr_scheduler_or_optimizer: Any,
                                         lr_scaling_method: str | None = "linear",
                                         verbose: bool = False) -> VariableBatchSizeLR:
    """DeepSpeed's builder: a :class:`VariableBatchSizeLR` over ``lr_scheduler_or_optimizer``,
    a scheduler, or an optimizer whose constant learning rates are then scaled."""
    target = lr_scheduler_or_optimizer
    if hasattr(target, "param_groups"):
        scheduler = ConstantLR(target)
    elif hasattr(getattr(target, "optimizer", None), "param_groups"):
        scheduler = target
    else:
        raise UsageValueError(f"cannot scale the learning rate of a {type(target).__name__}",
                              where="lr_scheduler_or_optimizer",
                              hint="pass an LR scheduler or the optimizer")
    return VariableBatchSizeLR(scheduler, base_batch_size, batch_sizes, dataloader,
                               lr_scaling_method=lr_scaling_method, verbose=verbose)


def _check_scheduler(scheduler: Any) -> None:
    if isinstance(scheduler, ReduceLROnPlateau):
        raise UsageError("ReduceLROnPlateau steps on a metric, not once per batch",
                         where="lr_scheduler",
                         hint="use a step-based scheduler with dynamic batching")
    if not hasattr(getattr(scheduler, "optimizer", None), "param_groups"):
        raise UsageValueError(f"a {type(scheduler).__name__} is not an LR scheduler (it has "
                              "no optimizer)", where="lr_scheduler")


def _initial_lrs(scheduler: Any) -> list[float]:
    """What a reset restores: torch's ``base_lrs`` (the initial learning rates), else what
    the scheduler computes now (DeepSpeed reads ``get_lr()`` of every scheduler, which
    for a torch one that has stepped is not its initial value)."""
    lrs = getattr(scheduler, "base_lrs", None)
    return [float(lr) for lr in (scheduler.get_lr() if lrs is None else lrs)]


def _set_lrs(optimizer: Any, lrs: Sequence[float]) -> None:
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def _positive(value: Any, where: str) -> int:
    if isinstance(value, bool) or int(value) != value or value <= 0:
        raise UsageError(f"must be a positive integer, not {value!r}", where=where)
    return int(value)
