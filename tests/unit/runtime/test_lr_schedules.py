"""DeepSpeed's LR schedules: values at every iteration, defaults, resumption, state dicts.

Each schedule is checked two ways: against independent reference code written from the
formulas in DeepSpeed's docstrings, for many parameter sets, and against values DeepSpeed
0.19.8 itself produced (recorded below) for a few.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import warnings

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler

from deepshard.errors import UsageError
from deepshard.runtime.lr_schedules import (
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")

STEPS = 60


def adam(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.zeros(2, requires_grad=True)], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups, lr=lrs[0], betas=(0.9, 0.999))


def sgd(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=lr, momentum=0.9)


def lr_history(optimizer, scheduler, steps: int = STEPS) -> list[list[float]]:
    """Group lrs after construction (index 0) and after each of ``steps`` calls to step()."""
    history = [[g["lr"] for g in optimizer.param_groups]]
    for _ in range(steps):
        scheduler.step()
        history.append([g["lr"] for g in optimizer.param_groups])
    return history


# ---- reference formulas; ``i`` is DeepSpeed's last_batch_iteration (-1 before any step) ----


def ref_warmup_gamma(i: int, n: int, kind: str) -> float:
    n = max(2, n)
    if kind == "log":
        return math.log(i + 1) / math.log(n)
    return i / n


def ref_warmup_lr(i, lo, hi, n, kind):
    if i < 0:
        return lo
    gamma = ref_warmup_gamma(i, n, kind) if i < max(2, n) else 1.0
    return lo + (hi - lo) * gamma


def ref_warmup_decay_lr(i, total, lo, hi, n, kind):
    n2 = max(2, n)
    if i < 0:
        return lo
    if i < n2:
        return lo + (hi - lo) * ref_warmup_gamma(i, n, kind)
    return lo + (hi - lo) * max(0.0, (total - i) / max(1.0, total - n2))


def ref_warmup_cosine_lr(i, base, total, min_ratio, n, cos_min, kind):
    n2 = max(2, n)
    if i < 0:
        return 0.0
    if i < n2:
        ratio = min_ratio + (1 - min_ratio) * ref_warmup_gamma(i, n, kind)
    else:
        progress = min(1.0, (i - n2 + 1) / max(1, total - n2))
        ratio = cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress))
    return base * ratio


def ref_one_cycle(i, lo, hi, mom_lo, mom_hi, first, second, stairs1, stairs2, dss, dlr, dmom):
    """(lr, momentum) at iteration i >= 0."""
    second = first if second is None else second
    stairs2 = stairs1 if stairs2 is None else stairs2
    total = first + second
    if i >= total:
        k = i - total + 1
        lr = lo if dss == 0 or dlr == 0 else lo / (1 + dlr * k / dss)
        mom = mom_hi if dss == 0 or dmom == 0 else mom_hi * (1 + dmom * k / dss)
        return lr, mom
    offset = (i + 1) % total
    if offset <= first:
        frac, stairs = offset / first, stairs1
        position = offset * stairs / first if stairs else None
    else:
        frac, stairs = (total - offset) / second, stairs2
        position = (total - offset) * stairs / second if stairs else None
    if stairs:
        frac = math.floor(position) / stairs
    return lo + (hi - lo) * frac, mom_hi - (mom_hi - mom_lo) * frac


def approx(value):
    return pytest.approx(value, rel=1e-12, abs=1e-15)


def assert_close(history: list[list[float]], expected: list[list[float]]) -> None:
    assert [len(row) for row in history] == [len(row) for row in expected]
    assert [v for row in history for v in row] == approx([v for row in expected for v in row])


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("num_steps", [1, 2, 7, 25])
@pytest.mark.parametrize("bounds", [(0.0, 0.001), (0.001, 0.05), (0.02, 0.01)])
def test_warmup_lr_matches_the_formula(kind, num_steps, bounds):
    lo, hi = bounds
    opt = adam(0.1)
    history = lr_history(opt, WarmupLR(opt, lo, hi, num_steps, kind))
    expected = [[ref_warmup_lr(n - 1, lo, hi, num_steps, kind)] for n in range(STEPS + 1)]
    assert_close(history, expected)


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize(("total", "num_steps"), [(40, 10), (30, 1), (5, 10), (50, 50)])
def test_warmup_decay_lr_matches_the_formula(kind, total, num_steps):
    opt = adam(0.1, 0.2)
    sched = WarmupDecayLR(opt, total, [0.0, 0.001], [0.01, 0.05], num_steps, kind)
    history = lr_history(opt, sched)
    expected = [
        [
            ref_warmup_decay_lr(n - 1, total, 0.0, 0.01, num_steps, kind),
            ref_warmup_decay_lr(n - 1, total, 0.001, 0.05, num_steps, kind),
        ]
        for n in range(STEPS + 1)
    ]
    assert_close(history, expected)
    assert history[-1] == [0.0, 0.001] or total > STEPS


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize(("total", "num_steps"), [(40, 10), (30, 1), (5, 10)])
@pytest.mark.parametrize(("min_ratio", "cos_min"), [(0.0, 0.0001), (0.1, 0.05)])
def test_warmup_cosine_lr_scales_each_groups_own_lr(kind, total, num_steps, min_ratio, cos_min):
    opt = adam(0.1, 0.3)
    sched = WarmupCosineLR(opt, total, min_ratio, num_steps, cos_min, kind)
    history = lr_history(opt, sched)
    expected = [
        [
            ref_warmup_cosine_lr(n - 1, base, total, min_ratio, num_steps, cos_min, kind)
            for base in (0.1, 0.3)
        ]
        for n in range(STEPS + 1)
    ]
    assert_close(history, expected)


ONE_CYCLE_SHAPES = list(
    itertools.product(
        (4, 7),  # first step size
        (None, 3, 0),  # second step size
        ((0, None), (2, None), (3, 0), (3, 2)),  # stair counts
        ((0, 0.5, 0.1), (5, 0.0, 0.0), (5, 0.5, 0.1)),  # decay step size, lr rate, mom rate
    )
)


@pytest.mark.parametrize(("first", "second", "stairs", "decay"), ONE_CYCLE_SHAPES)
def test_one_cycle_matches_the_formula(first, second, stairs, decay):
    dss, dlr, dmom = decay
    opt = adam(0.1)
    sched = OneCycle(
        opt,
        0.01,
        0.1,
        decay_lr_rate=dlr,
        cycle_first_step_size=first,
        cycle_second_step_size=second,
        cycle_first_stair_count=stairs[0],
        cycle_second_stair_count=stairs[1],
        decay_step_size=dss,
        decay_mom_rate=dmom,
    )
    # DeepSpeed sets the minimum momentum at construction, then the cycle's from step 1 on.
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)
    for n in range(1, STEPS + 1):
        sched.step()
        lr, mom = ref_one_cycle(n - 1, 0.01, 0.1, 0.8, 0.9, first, second, *stairs, *decay)
        assert opt.param_groups[0]["lr"] == approx(lr), n
        assert opt.param_groups[0]["betas"] == (approx(mom), 0.99), n


def test_one_cycle_leaves_sgd_momentum_alone_as_deepspeed_does(caplog):
    opt = sgd(0.1)
    with caplog.at_level(logging.WARNING):
        sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=4)
    assert "cycle_momentum is off" in caplog.text
    assert not sched.cycle_momentum
    for _ in range(10):
        sched.step()
        assert opt.param_groups[0]["momentum"] == 0.9
        assert "betas" not in opt.param_groups[0]


def test_one_cycle_per_group_bounds():
    opt = adam(0.1, 0.2)
    sched = OneCycle(
        opt, [0.01, 0.02], [0.1, 0.3], cycle_first_step_size=5, cycle_min_mom=[0.8, 0.85]
    )
    for n in range(1, 20):
        sched.step()
        for group, lo, hi, mom_lo in zip(
            opt.param_groups, (0.01, 0.02), (0.1, 0.3), (0.8, 0.85), strict=True
        ):
            lr, mom = ref_one_cycle(n - 1, lo, hi, mom_lo, 0.9, 5, None, 0, None, 0, 0, 0)
            assert group["lr"] == approx(lr)
            assert group["betas"][0] == approx(mom)


# Values DeepSpeed 0.19.8 produced: (number of step() calls, lr[, betas]).
DEEPSPEED_VALUES = [
    (
        WarmupLR,
        {"warmup_min_lr": 0.001, "warmup_max_lr": 0.05, "warmup_num_steps": 10},
        [(0, 0.001), (1, 0.001), (2, 0.015750469787535075), (5, 0.035249530212464915),
         (9, 0.047757882962526914), (10, 0.049999999999999996), (11, 0.05), (45, 0.05)],
    ),
    (
        WarmupLR,
        {"warmup_min_lr": 0.001, "warmup_max_lr": 0.05, "warmup_num_steps": 10,
         "warmup_type": "linear"},
        [(0, 0.001), (2, 0.005900000000000001), (5, 0.020600000000000004),
         (10, 0.0451), (11, 0.05)],
    ),
    (WarmupLR, {"warmup_num_steps": 1}, [(0, 0.0), (1, 0.0), (2, 0.1), (45, 0.1)]),
    (
        WarmupDecayLR,
        {"total_num_steps": 30, "warmup_min_lr": 0.001, "warmup_max_lr": 0.05,
         "warmup_num_steps": 10},
        [(0, 0.001), (5, 0.035249530212464915), (11, 0.05), (20, 0.027950000000000003),
         (29, 0.005900000000000001), (30, 0.0034500000000000004), (31, 0.001), (45, 0.001)],
    ),
    (
        WarmupDecayLR,
        {"total_num_steps": 30, "warmup_num_steps": 10, "warmup_type": "linear"},
        [(0, 0.0), (2, 0.0001), (10, 0.0009000000000000001), (11, 0.001), (20, 0.00055),
         (30, 5e-05), (31, 0.0)],
    ),
    (
        WarmupCosineLR,
        {"total_num_steps": 30, "warmup_num_steps": 10, "warmup_min_ratio": 0.1,
         "cos_min_ratio": 0.05},
        [(0, 0.0), (1, 0.010000000000000002), (2, 0.037092699609758306),
         (10, 0.09999999999999999), (11, 0.09941519617826905), (20, 0.052500000000000005),
         (29, 0.005584803821730962), (30, 0.005000000000000001), (45, 0.005000000000000001)],
    ),
    (
        WarmupCosineLR,
        {"total_num_steps": 30, "warmup_num_steps": 10, "warmup_type": "linear"},
        [(0, 0.0), (2, 0.010000000000000002), (11, 0.09938447858805392), (20, 0.050005),
         (29, 0.0006255214119460928), (30, 1e-05)],
    ),
    (
        OneCycle,
        {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10,
         "cycle_second_step_size": 5, "decay_step_size": 4, "decay_lr_rate": 0.5,
         "decay_mom_rate": 0.1},
        [(0, 0.01, (0.8, 0.99)), (1, 0.019, (0.89, 0.99)), (5, 0.055, (0.8500000000000001, 0.99)),
         (10, 0.09999999999999999, (0.8, 0.99)),
         (11, 0.08199999999999998, (0.8200000000000001, 0.99)),
         (20, 0.006153846153846154, (1.0125, 0.99)), (45, 0.002105263157894737, (1.575, 0.99))],
    ),
    (
        OneCycle,
        {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10,
         "cycle_first_stair_count": 3, "cycle_second_stair_count": 2},
        [(0, 0.01, (0.8, 0.99)), (1, 0.01, (0.9, 0.99)), (5, 0.04, (0.8666666666666667, 0.99)),
         (9, 0.07, (0.8333333333333334, 0.99)), (10, 0.1, (0.8, 0.99)),
         (11, 0.05500000000000001, (0.8500000000000001, 0.99)), (20, 0.01, (0.9, 0.99))],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("cls", "kwargs", "points"), DEEPSPEED_VALUES)
def test_values_recorded_from_deepspeed(cls, kwargs, points):
    opt = adam(0.1)
    sched = cls(opt, **kwargs)
    history = [(opt.param_groups[0]["lr"], opt.param_groups[0]["betas"])]
    for _ in range(max(p[0] for p in points)):
        sched.step()
        history.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
    for n, lr, *betas in points:
        assert history[n][0] == pytest.approx(lr, rel=1e-14, abs=0), n
        if betas:
            assert history[n][1] == pytest.approx(betas[0], rel=1e-14), n


def test_constructor_defaults_are_deepspeeds():
    recorded = {
        WarmupLR: {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
                   "warmup_type": "log", "last_batch_iteration": -1},
        WarmupDecayLR: {"total_num_steps": inspect.Parameter.empty, "warmup_min_lr": 0.0,
                        "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log",
                        "last_batch_iteration": -1},
        WarmupCosineLR: {"total_num_steps": inspect.Parameter.empty, "warmup_min_ratio": 0.0,
                         "warmup_num_steps": 1000, "cos_min_ratio": 0.0001, "warmup_type": "log",
                         "last_batch_iteration": -1},
        OneCycle: {"cycle_min_lr": inspect.Parameter.empty, "cycle_max_lr": inspect.Parameter.empty,
                   "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
                   "cycle_second_step_size": None, "cycle_first_stair_count": 0,
                   "cycle_second_stair_count": None, "decay_step_size": 0, "cycle_momentum": True,
                   "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0,
                   "last_batch_iteration": -1},
    }  # fmt: skip
    for cls, defaults in recorded.items():
        params = inspect.signature(cls.__init__).parameters
        assert {
            k: p.default for k, p in params.items() if k not in ("self", "optimizer")
        } == defaults


def make(kind: str, opt):
    return {
        "warmup": lambda: WarmupLR(opt, 0.001, 0.05, 10, "linear"),
        "decay": lambda: WarmupDecayLR(opt, 30, 0.001, 0.05, 10),
        "cosine": lambda: WarmupCosineLR(opt, 30, 0.1, 10, 0.05),
        "cycle": lambda: OneCycle(opt, 0.01, 0.1, 0.5, 7, 5, decay_step_size=3),
    }[kind]()


KINDS = ["warmup", "decay", "cosine", "cycle"]


@pytest.mark.parametrize("kind", KINDS)
def test_is_a_torch_scheduler_with_deepspeed_iteration_numbering(kind):
    opt = adam(0.1, 0.2)
    sched = make(kind, opt)
    assert isinstance(sched, LRScheduler)
    assert sched.last_batch_iteration == -1
    assert sched.get_last_lr() == [g["lr"] for g in opt.param_groups]
    for n in range(5):
        sched.step()
        assert sched.last_batch_iteration == n
        assert sched.get_last_lr() == [g["lr"] for g in opt.param_groups]
        assert sched.get_lr() == [g["lr"] for g in opt.param_groups]


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip_restores_the_sequence(kind):
    opt = adam(0.1, 0.2)
    sched = make(kind, opt)
    for _ in range(13):
        sched.step()
    buffer = torch.serialization.io.BytesIO()
    torch.save(sched.state_dict(), buffer)
    expected = lr_history(opt, sched, 30)[1:]

    fresh_opt = adam(0.1, 0.2)
    fresh = make(kind, fresh_opt)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.last_batch_iteration == 12
    assert lr_history(fresh_opt, fresh, 30)[1:] == expected


@pytest.mark.parametrize("kind", KINDS)
def test_loads_a_deepspeed_state_dict(kind):
    opt = adam(0.1, 0.2)
    sched = make(kind, opt)
    for _ in range(9):
        sched.step()
    lrs_at_8 = [g["lr"] for g in opt.param_groups]
    expected = lr_history(opt, sched, 20)[1:]
    fresh_opt = adam(0.1, 0.2)
    fresh = make(kind, fresh_opt)
    fresh.load_state_dict({"last_batch_iteration": 8})
    assert fresh.last_batch_iteration == 8
    assert fresh.get_last_lr() == lrs_at_8
    assert lr_history(fresh_opt, fresh, 20)[1:] == expected


def test_resuming_via_last_batch_iteration_and_jumping_with_step():
    opt = adam(0.1)
    sched = WarmupDecayLR(opt, 30, 0.001, 0.05, 10)
    full = lr_history(opt, sched, 25)
    resumed_opt = adam(0.1)
    resumed = WarmupDecayLR(resumed_opt, 30, 0.001, 0.05, 10, last_batch_iteration=11)
    assert resumed_opt.param_groups[0]["lr"] == full[12][0]
    assert lr_history(resumed_opt, resumed, 13)[1:] == full[13:]
    resumed.step(4)
    assert resumed.last_batch_iteration == 4
    assert resumed_opt.param_groups[0]["lr"] == full[5][0]


def test_warmup_lr_max_defaults_to_each_groups_lr():
    opt = adam(0.1, 0.3)
    sched = WarmupLR(opt, warmup_num_steps=2)
    assert lr_history(opt, sched, 3)[-1] == [0.1, 0.3]


def test_bad_arguments():
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        WarmupLR(adam(0.1), warmup_num_steps=0)
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupCosineLR(adam(0.1), 10, warmup_num_steps=2.5)
    with pytest.raises(ValueError, match="expected 2 values for warmup_max_lr"):
        WarmupLR(adam(0.1, 0.2), warmup_max_lr=[0.1])
    with pytest.raises(ValueError, match="cycle_first_step_size must be positive"):
        OneCycle(adam(0.1), 0.01, 0.1, cycle_first_step_size=0)


def test_unknown_warmup_type_falls_back_to_log(caplog):
    with caplog.at_level(logging.WARNING):
        sched = WarmupLR(adam(0.1), 0.0, 0.1, 10, "cubic")
    assert sched.warmup_type == "log"
    assert "cubic" in caplog.text


def test_build_scheduler():
    opt = adam(0.1)
    sched = build_scheduler("WarmupLR", {"warmup_max_lr": 0.05, "warmup_num_steps": 4}, opt)
    assert isinstance(sched, WarmupLR)
    assert lr_history(opt, sched, 5)[-1] == [0.05]
    assert isinstance(
        build_scheduler("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0}, opt), OneCycle
    )


@pytest.mark.parametrize(
    ("type_name", "params", "where"),
    [
        ("LinearLR", {}, "scheduler.type"),
        ("WarmupLR", {"warmup_steps": 4}, "scheduler.params.warmup_steps"),
        ("WarmupLR", {"warmup_num_steps": -1}, "scheduler.params"),
        ("WarmupDecayLR", {}, "scheduler.params"),
    ],
)
def test_build_scheduler_errors_name_the_key(type_name, params, where):
    with pytest.raises(UsageError) as info:
        build_scheduler(type_name, params, adam(0.1))
    assert info.value.where == where


def test_no_torch_warnings_when_used_in_order():
    param = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([param], lr=0.1)
    sched = WarmupLR(opt, warmup_num_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            param.grad = torch.ones(2)
            opt.step()
            sched.step()


def _sgd(lr=0.1):
    import torch

    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _adam(lr=0.1):
    import torch

    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def test_warmup_cosine_with_a_tensor_lr_is_deepspeed_s():
    """DeepSpeed 0.19.8 (total 100, warmup 10, log): 0.0 before the first step, 0.030103
    after ``step(1)``, with a tensor lr as with a float (it keeps a copy of the lr)."""
    import torch

    from deepshard.runtime.lr_schedules import WarmupCosineLR

    for lr in (0.1, torch.tensor(0.1)):
        opt = _sgd(lr)
        sched = WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10)
        assert float(opt.param_groups[0]["lr"]) == 0.0
        sched.step(1)
        assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.030103, abs=1e-6)


def test_one_cycle_momentum_is_deepspeed_s_beta_tuples():
    """DeepSpeed 0.19.8 (cycle 0.01-0.1 over 4 steps, momentum 0.8-0.9, Adam): get_mom()
    is [(0.9, 0.99)] before the first step, then [(0.875, 0.99)], [(0.85, 0.99)]; the lr
    0.0325, 0.055, 0.0775; the optimizer's betas follow."""
    from deepshard.runtime.lr_schedules import OneCycle

    opt = _adam()
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4)
    assert sched.get_mom() == [(0.9, 0.99)]
    moms, lrs = [], []
    for _ in range(3):
        sched.step()
        moms.append(sched.get_mom()[0])
        lrs.append(opt.param_groups[0]["lr"])
    assert moms == [pytest.approx((0.875, 0.99)), pytest.approx((0.85, 0.99)),
                    pytest.approx((0.825, 0.99))]
    assert opt.param_groups[0]["betas"] == pytest.approx((0.825, 0.99))
    assert lrs == pytest.approx([0.0325, 0.055, 0.0775])


def test_lr_range_test_is_deepspeed_s():
    """DeepSpeed 0.19.8 (min 0.001, step size 2, rate 1): 0.001 before the first step,
    then 0.0015, 0.002, 0.0025, 0.003; the config accepts the type; the module has
    DeepSpeed's key constants."""
    from deepshard.config import parse_config
    from deepshard.runtime import lr_schedules
    from deepshard.runtime.lr_schedules import LRRangeTest, build_scheduler

    opt = _sgd()
    sched = LRRangeTest(opt, lr_range_test_min_lr=0.001, lr_range_test_step_size=2)
    got = [opt.param_groups[0]["lr"]]
    for _ in range(4):
        sched.step()
        got.append(opt.param_groups[0]["lr"])
    assert got == pytest.approx([0.001, 0.0015, 0.002, 0.0025, 0.003])
    stairs = LRRangeTest(_sgd(), lr_range_test_min_lr=0.001, lr_range_test_step_size=2,
                         lr_range_test_staircase=True)
    assert [stairs.get_lr()[0] for _ in [stairs.step() for _ in range(2)]] == pytest.approx(
        [0.002, 0.002])
    cfg = parse_config({"train_micro_batch_size_per_gpu": 1, "scheduler": {
        "type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.001,
                                          "lr_range_test_step_size": 2}}}).config
    built = build_scheduler(cfg.scheduler.type, cfg.scheduler.params.model_dump(), _sgd())
    assert isinstance(built, LRRangeTest)
    assert lr_schedules.WARMUP_MIN_LR == "warmup_min_lr"
    assert lr_schedules.CYCLE_FIRST_STEP_SIZE == "cycle_first_step_size"
    assert lr_schedules.LR_RANGE_TEST_STAIRCASE == "lr_range_test_staircase"
