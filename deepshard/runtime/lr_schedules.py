"""DeepSpeed's learning-rate schedules as torch ``LRScheduler`` subclasses.

A DeepSpeed config names one of ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``,
``OneCycle`` or ``LRRangeTest``; a job moved over from DeepSpeed must see the same learning
rate at every iteration, so each class reproduces DeepSpeed's formulas, keyword names and
defaults, including its quirks (noted where they live). Subclassing torch's base class
means ``state_dict``, ``get_last_lr`` and any torch code that expects a scheduler work
unchanged.

Iterations are counted as DeepSpeed counts them: ``last_batch_iteration`` (torch's
``last_epoch``) is -1 after construction and ``n - 1`` after ``n`` calls to ``step()``.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from deepshard.errors import UsageError

logger = logging.getLogger(__name__)

WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer: Optimizer, value: Any, name: str) -> list:
    """A scalar broadcast to every param group, or a list/tuple checked to have one per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(
                f"expected {len(optimizer.param_groups)} values for {name} (one per param group), "
                f"got {len(value)}"
            )
        return list(value)
    return [value] * len(optimizer.param_groups)


def _check_warmup(warmup_num_steps: object, warmup_type: str) -> str:
    """Check the warmup length; an unknown type falls back to ``log``, as in DeepSpeed."""
    if (
        isinstance(warmup_num_steps, bool)
        or not isinstance(warmup_num_steps, int)
        or (warmup_num_steps <= 0)
    ):
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in WARMUP_TYPES:
        logger.warning("unknown warmup_type %r; using 'log'", warmup_type)
        return "log"
    return warmup_type


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far warmup has come at ``iteration`` (< ``warmup_num_steps``): 0 at iteration 0."""
    if warmup_type == "log":
        # Multiplying by the reciprocal (not dividing) keeps the floats bit-identical to DeepSpeed.
        return (1.0 / math.log(warmup_num_steps)) * math.log(iteration + 1)
    return iteration / warmup_num_steps


class _DeepSpeedSchedule(LRScheduler):
    """Shared plumbing: DeepSpeed's iteration numbering on top of torch's ``last_epoch``."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int) -> None:
        # torch's base class checks for 'initial_lr' when resuming; setting it for every start
        # lets last_epoch equal DeepSpeed's last_batch_iteration instead of running one ahead.
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        super().__init__(optimizer, last_epoch=last_batch_iteration - 1)

    @property
    def last_batch_iteration(self) -> int:
        """The iteration whose learning rate is in effect: -1 before the first ``step()``."""
        return self.last_epoch

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration, or jump to ``last_batch_iteration``, and apply its lr."""
        if last_batch_iteration is not None:
            self.last_epoch = last_batch_iteration - 1
        super().step()

    def state_dict(self) -> dict[str, Any]:
        """torch's state, plus DeepSpeed's ``last_batch_iteration`` (what DeepSpeed's
        schedules load: a checkpoint deepshard wrote resumes in DeepSpeed)."""
        return {**super().state_dict(), "last_batch_iteration": self.last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own ``state_dict()``, or a DeepSpeed one (``{'last_batch_iteration': n}``)."""
        if "last_epoch" not in state_dict and "last_batch_iteration" in state_dict:
            self.last_epoch = int(state_dict["last_batch_iteration"])
            self._last_lr = list(self.get_lr())
            return
        super().load_state_dict({k: v for k, v in state_dict.items()
                                 if k != "last_batch_iteration"})


class WarmupLR(_DeepSpeedSchedule):
    """Warm up each group's lr from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    At iteration ``i < warmup_num_steps`` the lr is ``min + (max - min) * gamma`` with
    ``gamma = log(i + 1) / log(warmup_num_steps)`` (``log``) or ``i / warmup_num_steps``
    (``linear``); from then on it is ``warmup_max_lr``. Before the first ``step()`` it is
    ``warmup_min_lr``.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` this sets.
        warmup_min_lr: starting lr; a scalar or one value per param group.
        warmup_max_lr: lr after warmup; ``None`` (DeepSpeed's default) takes each group's lr.
        warmup_num_steps: warmup length in iterations; values below 2 act as 2, as in DeepSpeed.
        warmup_type: ``"log"`` or ``"linear"``; anything else warns and uses ``"log"``.
        last_batch_iteration: the last iteration already taken, when resuming; -1 to start.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.warmup_type = _check_warmup(warmup_num_steps, warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_epoch < self.warmup_num_steps:
            return _warmup_fraction(self.last_epoch, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        """Per-group lr at ``last_batch_iteration``."""
        if self.last_epoch < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`'s warmup, then a linear decay that reaches 0 at ``total_num_steps``.

    After warmup, ``gamma = max(0, (total_num_steps - i) / max(1, total_num_steps -
    warmup_num_steps))``. Note that ``warmup_max_lr`` defaults to 0.001 here, not to the
    optimizer's lr as in :class:`WarmupLR` (DeepSpeed's defaults differ the same way).

    Args:
        optimizer: the optimizer whose param groups' ``lr`` this sets.
        total_num_steps: the iteration at which the lr reaches 0.
        warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration:
            as for :class:`WarmupLR`.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "total_num_steps %s is less than warmup_num_steps %s",
                total_num_steps,
                warmup_num_steps,
            )

    def _gamma(self) -> float:
        if self.last_epoch < self.warmup_num_steps:
            return _warmup_fraction(self.last_epoch, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1.0, float(self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - self.last_epoch) / decay_steps)


class WarmupCosineLR(_DeepSpeedSchedule):
    """Scale each group's own lr by a ratio: warmup to 1, then cosine decay to ``cos_min_ratio``.

    The ratio multiplies the lr each group had when the scheduler was built. During warmup it
    is ``warmup_min_ratio + (1 - warmup_min_ratio) * gamma`` (gamma as in :class:`WarmupLR`);
    afterwards ``cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2`` where the
    progress ``p = min(1, (i - warmup_num_steps + 1) / max(1, total_num_steps -
    warmup_num_steps))``. Before the first ``step()`` the lr is 0 (not
    ``warmup_min_ratio`` times the lr), as in DeepSpeed.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` this sets.
        total_num_steps: the iteration at which the ratio reaches ``cos_min_ratio``.
        warmup_min_ratio: ratio at iteration 0.
        warmup_num_steps: warmup length; values below 2 act as 2.
        cos_min_ratio: the ratio at and after ``total_num_steps``.
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: the last iteration already taken, when resuming; -1 to start.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.warmup_type = _check_warmup(warmup_num_steps, warmup_type)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        # a copy: torch writes a tensor lr in place (fill_), which would change these too
        self.org_lrs = [group["lr"].clone() if hasattr(group["lr"], "clone") else group["lr"]
                        for group in optimizer.param_groups]
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "total_num_steps %s is less than warmup_num_steps %s",
                total_num_steps,
                warmup_num_steps,
            )
        super().__init__(optimizer, last_batch_iteration)

    def get_lr_ratio(self) -> float:
        """The factor applied to each group's original lr at ``last_batch_iteration``."""
        i = self.last_epoch
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            gamma = _warmup_fraction(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (i - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        """Per-group lr at ``last_batch_iteration``."""
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_DeepSpeedSchedule):
    """The 1-cycle policy: lr up then down over one cycle, then optional decay; momentum mirrored.

    Over a cycle of ``first + second`` iterations the lr rises linearly from ``cycle_min_lr``
    to ``cycle_max_lr`` and falls back; with a stair count the rise or fall moves in that many
    flat steps. After the cycle, with ``decay_step_size > 0``, the lr is ``cycle_min_lr / (1 +
    decay_lr_rate * k / decay_step_size)`` at the k-th iteration past the cycle (``k`` from 1).

    Momentum moves opposite to the lr between ``cycle_max_mom`` and ``cycle_min_mom``, then
    decays as ``cycle_max_mom * (1 + decay_mom_rate * k / decay_step_size)``. As in DeepSpeed it
    is written to ``betas`` only when the optimizer's defaults have ``betas`` (Adam-style); for
    other optimizers (SGD) ``cycle_momentum`` is turned off with a warning. Also as in
    DeepSpeed, ``betas`` becomes ``(momentum, 0.99)``: the second beta is replaced by 0.99, and
    the momentum right after construction is ``cycle_min_mom`` while the first ``step()`` sets
    ``cycle_max_mom``.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` (and ``betas``) this sets.
        cycle_min_lr, cycle_max_lr: the cycle's lr bounds; scalars or one per param group.
        decay_lr_rate: lr decay rate after the cycle; 0 disables lr decay.
        cycle_first_step_size: iterations in the rising half (> 0).
        cycle_second_step_size: iterations in the falling half; ``None`` means the same.
        cycle_first_stair_count: stairs in the rising half; 0 means continuous.
        cycle_second_stair_count: stairs in the falling half; ``None`` means the same.
        decay_step_size: the decay interval after the cycle; 0 disables decay.
        cycle_momentum: whether to cycle momentum.
        cycle_min_mom, cycle_max_mom: the momentum bounds; scalars or one per param group.
        decay_mom_rate: momentum decay rate after the cycle.
        last_batch_iteration: the last iteration already taken, when resuming; -1 to start.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if second < 0:
            raise ValueError(
                f"cycle_second_step_size must be non-negative, got {cycle_second_step_size}"
            )
        self.first_step_size = first
        self.second_step_size = second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count
            if cycle_second_stair_count is None
            else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        if cycle_momentum and "betas" not in optimizer.defaults:
            logger.warning(
                "OneCycle: cycle_momentum is off because %s has no 'betas'",
                type(optimizer).__name__,
            )
            cycle_momentum = False
        self.cycle_momentum = cycle_momentum
        self.min_moms = (
            _per_group(optimizer, cycle_min_mom, "cycle_min_mom") if cycle_momentum else []
        )
        self.max_moms = (
            _per_group(optimizer, cycle_max_mom, "cycle_max_mom") if cycle_momentum else []
        )
        super().__init__(optimizer, last_batch_iteration)
        if last_batch_iteration == -1 and cycle_momentum:
            self._set_momentum([(m, 0.99) for m in self.min_moms])

    def _scale_factor(self) -> float:
        """Position in the cycle of iteration ``last_batch_iteration + 1``: 0 at ends, 1 at peak."""
        batch = self.last_epoch + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Stairs come from the integer offset, not from scale: the float scale can land
            # a hair under an exact stair and floor() would drop a whole stair.
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_iteration(self) -> float | None:
        """Iterations past the cycle (from 1), or ``None`` while still in the cycle."""
        if self.last_epoch < self.total_size:
            return None
        return self.last_epoch - self.total_size + 1

    def get_lr(self) -> list[float]:
        """Per-group lr at ``last_batch_iteration``."""
        k = self._decay_iteration()
        if k is None:
            scale = self._scale_factor()
            return [
                lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)
            ]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (k / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Per-group ``(beta1, beta2)`` at ``last_batch_iteration``, as DeepSpeed returns them
        (beta2 is 0.99, as DeepSpeed writes it); ``None`` when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        k = self._decay_iteration()
        if k is None:
            scale = self._scale_factor()
            firsts = [hi - (hi - lo) * scale
                      for lo, hi in zip(self.min_moms, self.max_moms, strict=True)]
        elif self.skip_mom_decay:
            firsts = list(self.max_moms)
        else:
            factor = 1 + self.decay_mom_rate * (k / self.decay_step_size)
            firsts = [hi * factor for hi in self.max_moms]
        return [(beta1, 0.99) for beta1 in firsts]

    def _set_momentum(self, moms: list[tuple[float, float]]) -> None:
        for group, betas in zip(self.optimizer.param_groups, moms, strict=True):
            group["betas"] = betas

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to one) and apply its lr and momentum."""
        super().step(last_batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            self._set_momentum(moms)


class LRRangeTest(_DeepSpeedSchedule):
    """DeepSpeed's LR range test: ``lr = min_lr * (1 + step_rate * (i + 1) / step_size)``
    at iteration ``i`` (``floor`` of the fraction with ``staircase``), from ``min_lr``
    before the first ``step()``.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` this sets.
        lr_range_test_min_lr: the starting lr (one value, or one per param group).
        lr_range_test_step_size: iterations per unit of growth.
        lr_range_test_step_rate: growth per unit.
        lr_range_test_staircase: whole units only.
        last_batch_iteration: the last iteration already taken, when resuming; -1 to start.
    """

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        if isinstance(lr_range_test_step_size, bool) or not isinstance(
                lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ValueError("lr_range_test_step_size must be a positive integer, got "
                             f"{lr_range_test_step_size}")
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def get_lr(self) -> list[float]:
        """Per-group lr at ``last_batch_iteration``."""
        interval = (self.last_epoch + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lr]


# DeepSpeed's names of the schedule types and their parameters (runtime/lr_schedules.py);
# Accelerate reads VALID_LR_SCHEDULES
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR = "LRRangeTest", "OneCycle", "WarmupLR"
WARMUP_DECAY_LR, WARMUP_COSINE_LR = "WarmupDecayLR", "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE, MID_VALUE = "edge_value", "mid_value"
CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT = "cycle_first_step_size", "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = "cycle_min_lr", "cycle_max_lr", "decay_lr_rate"
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR = "warmup_min_lr", "warmup_max_lr"
WARMUP_NUM_STEPS, WARMUP_TYPE = "warmup_num_steps", "warmup_type"
WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "log", "linear"
WARMUP_MIN_RATIO, COS_MIN_RATIO = "warmup_min_ratio", "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

SCHEDULERS: Mapping[str, type[LRScheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}


def build_scheduler(
    type_name: str, params: Mapping[str, object], optimizer: Optimizer
) -> LRScheduler:
    """Build the schedule a DeepSpeed config's ``scheduler`` section names.

    Args:
        type_name: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` or ``OneCycle``.
        params: the section's ``params``, passed as keyword arguments to the class.
        optimizer: the optimizer to schedule.

    Raises:
        UsageError: an unknown type, an unknown parameter, or a value the schedule rejects,
            with the config key path.
    """
    cls = SCHEDULERS.get(type_name)
    if cls is None:
        raise UsageError(
            f"unknown scheduler type {type_name!r}",
            where="scheduler.type",
            hint=f"use one of {', '.join(SCHEDULERS)}",
        )
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "optimizer"}
    for key in params:
        if key not in accepted:
            raise UsageError(
                f"{type_name} has no parameter {key!r}",
                where=f"scheduler.params.{key}",
                hint=f"{type_name} accepts {', '.join(sorted(accepted))}",
            )
    try:
        return cls(optimizer, **params)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{type_name}: {err}", where="scheduler.params") from err
