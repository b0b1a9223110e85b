"""The fp16 loss scaler's state machine, driven by scripted overflow sequences.

Expected scales are worked out by hand from DeepSpeed's rules (``DynamicLossScaler`` in
``deepspeed/runtime/fp16/loss_scaler.py``): iterations count from 0, the last overflow starts
at -1, a clean iteration ``i`` grows the scale when ``i - last_overflow - 1`` is a positive
multiple of the window, and an overflow halves it only when the hysteresis is at 1.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from deepshard.errors import UsageError
from deepshard.runtime.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    StaticLossScaler,
    build_loss_scaler,
    has_overflow,
)

OV, OK = True, False  # overflow, clean iteration


def scales(scaler: DynamicLossScaler, script: list[bool]) -> list[float]:
    """The scale after each scripted iteration."""
    out = []
    for overflow in script:
        scaler.update_scale(overflow)
        out.append(scaler.loss_scale)
    return out


def test_grows_after_each_clean_window():
    scaler = DynamicLossScaler(init_scale=8, scale_window=2)
    # i=2 and i=4: stable interval 2 and 4, multiples of the window.
    assert scales(scaler, [OK] * 6) == [8, 8, 16, 16, 32, 32]


def test_halves_on_every_overflow_without_hysteresis_and_restarts_the_window():
    scaler = DynamicLossScaler(init_scale=64, scale_window=3, delayed_shift=1)
    # Overflows at 0 and 1; stable interval at i = 2, 3, 4, 5 is 0, 1, 2, 3 -> grows at i=5.
    assert scales(scaler, [OV, OV, OK, OK, OK, OK, OK]) == [32, 16, 16, 16, 16, 32, 32]


def test_hysteresis_delays_the_first_halving_and_is_refilled_by_growth():
    scaler = DynamicLossScaler(init_scale=64, scale_window=2, delayed_shift=2)
    script = [OV, OV, OV, OK, OK, OK, OV, OV]
    # i0: hysteresis 2 -> 1, scale kept. i1, i2: halve (the counter stays at 1). i3, i4: stable
    # 0, 1. i5: stable 2 -> grow and refill to 2. i6: 2 -> 1. i7: halve.
    assert scales(scaler, script) == [64, 32, 16, 16, 16, 32, 32, 16]


def test_without_consecutive_hysteresis_a_clean_step_does_not_refill():
    scaler = DynamicLossScaler(init_scale=64, scale_window=100, delayed_shift=2)
    assert scales(scaler, [OV, OK, OV, OK, OV]) == [64, 64, 32, 32, 16]
    assert scaler.cur_hysteresis == 1


def test_consecutive_hysteresis_refills_on_every_clean_step():
    scaler = DynamicLossScaler(
        init_scale=64, scale_window=100, delayed_shift=2, consecutive_hysteresis=True
    )
    assert scales(scaler, [OV, OK, OV, OK, OV, OV]) == [64, 64, 64, 64, 64, 32]


def test_halving_is_floored_at_min_scale_then_raises():
    scaler = DynamicLossScaler(init_scale=8, scale_window=5, min_scale=3)
    assert scales(scaler, [OV, OV]) == [4, 3]
    before = scaler.state_dict()
    with pytest.raises(LossScaleAtMinimumError, match="keeps overflowing") as info:
        scaler.update_scale(True)
    assert isinstance(info.value, RuntimeError)
    assert "minimum 3" in str(info.value)
    assert "HINT:" in str(info.value)
    assert scaler.state_dict() == before


def test_min_scale_error_waits_for_the_hysteresis():
    scaler = DynamicLossScaler(init_scale=1, min_scale=1, delayed_shift=2)
    scaler.update_scale(True)  # hysteresis 2 -> 1; no decrease attempted yet
    with pytest.raises(LossScaleAtMinimumError):
        scaler.update_scale(True)


def test_min_scale_without_raising_stays_at_min():
    scaler = DynamicLossScaler(init_scale=2, min_scale=1, raise_error_at_min_scale=False)
    assert scales(scaler, [OV, OV, OV]) == [1, 1, 1]


def test_state_dict_round_trip_continues_identically():
    script = [OV, OK, OK, OV, OV, OK, OK, OK, OK, OK, OV, OK, OK, OK, OK, OK, OK]
    a = DynamicLossScaler(init_scale=2**10, scale_window=3, delayed_shift=2)
    scales(a, script[:6])
    b = DynamicLossScaler(init_scale=2**10, scale_window=3, delayed_shift=2)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert scales(b, script[6:]) == scales(a, script[6:])
    assert b.state_dict() == a.state_dict()


def test_loss_scale_is_a_float():
    assert isinstance(DynamicLossScaler().loss_scale, float)
    assert DynamicLossScaler().loss_scale == 2.0**16
    assert isinstance(StaticLossScaler(128).loss_scale, float)


def test_static_scaler_never_changes():
    scaler = StaticLossScaler(128)
    scaler.update_scale(True)
    scaler.update_scale(False)
    assert scaler.loss_scale == 128.0
    assert not scaler.dynamic
    fresh = StaticLossScaler(1)
    fresh.load_state_dict(scaler.state_dict())
    assert fresh.loss_scale == 128.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scale_window": 0},
        {"delayed_shift": 0},
        {"min_scale": 0},
        {"init_scale": -1},
        {"scale_factor": 1.0},
    ],
)
def test_rejects_settings_that_break_the_state_machine(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        DynamicLossScaler(**kwargs)


# ---- has_overflow ----


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_has_overflow_finds_one_bad_value(dtype, bad):
    tensors = [torch.zeros(7, dtype=dtype), torch.ones(3, 5, dtype=dtype)]
    assert not has_overflow(tensors)
    tensors[1][2, 3] = bad
    assert has_overflow(tensors)


def test_has_overflow_ignores_large_finite_fp16_values():
    # The 2-norm of this tensor (1e6) does not fit fp16; the values themselves do.
    assert not has_overflow([torch.full((10_000,), 1e4, dtype=torch.float16)])


def test_has_overflow_skips_none_and_empty_and_reads_sparse_values():
    assert not has_overflow([])
    assert not has_overflow([None, torch.empty(0), torch.ones(2)])
    sparse = torch.sparse_coo_tensor([[0, 3]], [1.0, math.inf], (5,), check_invariants=True)
    assert has_overflow([None, sparse])
    assert not has_overflow([torch.sparse_coo_tensor([[1]], [2.0], (5,), check_invariants=True)])


def test_has_overflow_mixed_dtypes():
    tensors = [
        torch.ones(4, dtype=torch.float16),
        torch.ones(4),
        torch.ones(2, dtype=torch.bfloat16),
    ]
    assert not has_overflow(tensors)
    tensors[2][0] = math.nan
    assert has_overflow(tensors)


# ---- build_loss_scaler ----


def fp16(**overrides):
    section = {
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    }
    section.update(overrides)
    return section


def test_build_dynamic_from_deepspeed_defaults():
    scaler = build_loss_scaler(SimpleNamespace(**fp16()))
    assert isinstance(scaler, DynamicLossScaler)
    assert scaler.loss_scale == 65536.0
    assert (scaler.scale_window, scaler.delayed_shift, scaler.min_scale) == (1000, 2, 1.0)
    assert scaler.scale_factor == 2.0
    assert scaler.raise_error_at_min_scale
    assert not scaler.consecutive_hysteresis


def test_build_from_a_mapping_with_custom_values():
    scaler = build_loss_scaler(
        fp16(initial_scale_power=8, loss_scale_window=50, hysteresis=1, min_loss_scale=4,
             consecutive_hysteresis=True)
    )  # fmt: skip
    assert scaler.loss_scale == 256.0
    assert (scaler.scale_window, scaler.delayed_shift, scaler.min_scale) == (50, 1, 4.0)
    assert scaler.consecutive_hysteresis


def test_build_static_when_loss_scale_is_positive():
    scaler = build_loss_scaler(fp16(loss_scale=512))
    assert isinstance(scaler, StaticLossScaler)
    assert scaler.loss_scale == 512.0


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        ({"loss_scale": -1}, "fp16.loss_scale"),
        ({"hysteresis": 0}, "fp16.hysteresis"),
        ({"loss_scale_window": 0}, "fp16.loss_scale_window"),
        ({"min_loss_scale": 0}, "fp16.min_loss_scale"),
    ],
)
def test_build_errors_name_the_key(overrides, where):
    with pytest.raises(UsageError) as info:
        build_loss_scaler(fp16(**overrides))
    assert info.value.where == where
