"""The compressed all-reduce's arithmetic in one process: bit packing, the simulation's
invariants, and error feedback keeping the running sum on track."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepshard.runtime.optim.onebit.compressed import (
    CompressedAllreduce,
    pack_signs,
    padded_numel,
    simulate,
    unpack_signs,
)
from tests.kernels.support import needs_gpu

FLOATS = st.floats(allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(FLOATS, min_size=0, max_size=80).map(lambda v: v + [0.0] * (-len(v) % 8)))
def test_pack_round_trip_and_layout(values):
    x = torch.tensor(values, dtype=torch.float32)
    bits = pack_signs(x)
    assert bits.dtype == torch.uint8 and bits.numel() == x.numel() // 8
    expected = np.packbits((x >= 0).numpy(), bitorder="little")
    assert np.array_equal(bits.numpy(), expected)
    assert torch.equal(unpack_signs(bits), torch.where(x >= 0, 1.0, -1.0))


def test_sign_of_negative_zero_is_one_and_bad_input_is_a_value_error():
    assert pack_signs(torch.tensor([-0.0, -1.0] + [1.0] * 6)).item() == 0b11111101
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(7))
    with pytest.raises(ValueError, match="uint8"):
        unpack_signs(torch.ones(2))


def test_padding_and_error_sizes(one_rank_group):
    car = CompressedAllreduce()
    assert [car.padded_numel(n) for n in (0, 1, 8, 9)] == [0, 8, 8, 16]
    assert [padded_numel(n, 4) for n in (1, 32, 33)] == [32, 32, 64]
    w, s = car.new_errors(9)
    assert w.shape == (16,) and s.shape == (16,) and not w.any() and not s.any()
    with pytest.raises(ValueError, match="multiple of 8"):
        car(torch.zeros(12), torch.zeros(12), torch.zeros(12))
    with pytest.raises(ValueError, match="server_error"):
        car(torch.zeros(8), torch.zeros(8), torch.zeros(4))


def rank_inputs(world: int, n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) + 0.3 * r for r in range(world)]


def test_one_call_is_sign_times_rms_per_chunk():
    world, n = 2, 32
    xs = rank_inputs(world, n, 0)
    buffers = [x.clone() for x in xs]
    errors = [torch.zeros(n) for _ in range(world)], [torch.zeros(n // world) for _ in range(world)]
    simulate(buffers, *errors)
    for x, w in zip(xs, errors[0], strict=True):
        for chunk, err in zip(x.view(world, -1), w.view(world, -1), strict=True):
            rms = chunk.norm() / chunk.numel() ** 0.5
            torch.testing.assert_close(chunk - err, torch.where(chunk >= 0, rms, -rms))
    mean = sum(
        torch.where(x.view(world, -1) >= 0, 1.0, -1.0) * (x.view(world, -1).norm(dim=1,
                                                                              keepdim=True)
                                                          / (n // world) ** 0.5)
        for x in xs) / world
    for r in range(world):
        y = mean[r]
        rms = y.norm() / y.numel() ** 0.5
        torch.testing.assert_close(buffers[0].view(world, -1)[r], torch.where(y >= 0, rms, -rms))
        torch.testing.assert_close(errors[1][r], y - torch.where(y >= 0, rms, -rms))
    assert all(torch.equal(b, buffers[0]) for b in buffers)


def drift(world: int, n: int, steps: int, feedback: bool) -> list[float]:
    """Max |running sum of outputs - running sum of true averages| after each step."""
    padded = padded_numel(n, world)
    workers = [torch.zeros(padded) for _ in range(world)]
    servers = [torch.zeros(padded // world) for _ in range(world)]
    out_sum, true_sum, gaps = torch.zeros(padded), torch.zeros(padded), []
    for step in range(steps):
        xs = [torch.nn.functional.pad(x, (0, padded - n)) for x in rank_inputs(world, n, step)]
        buffers = [x.clone() for x in xs]
        if not feedback:
            for e in (*workers, *servers):
                e.zero_()
        simulate(buffers, workers, servers)
        out_sum += buffers[0]
        true_sum += sum(xs) / world
        gaps.append((out_sum - true_sum).abs().max().item())
    return gaps


@pytest.mark.parametrize("world", [2, 4])
def test_error_feedback_keeps_the_running_sum_within_a_bound_that_does_not_grow(world):
    with_feedback = drift(world, 61, 120, feedback=True)
    without = drift(world, 61, 120, feedback=False)
    # with feedback the gap stays at its early size: it is the errors left in flight
    assert max(with_feedback[60:]) < 1.5 * max(with_feedback[:60])
    assert max(with_feedback) < 6
    # without it the biased signs accumulate: the gap keeps growing with the steps
    assert without[-1] > 3 * max(with_feedback)
    assert np.mean(without[90:]) > 1.5 * np.mean(without[20:40])


@pytest.mark.gpu
@needs_gpu
def test_the_cuda_path_packs_and_simulates_as_the_cpu_path():
    x = torch.randn(8 * 1001, generator=torch.Generator().manual_seed(3))
    x[::5] = -0.0
    bits = pack_signs(x.cuda())
    assert bits.is_cuda and torch.equal(bits.cpu(), pack_signs(x))
    assert torch.equal(unpack_signs(bits).cpu(), unpack_signs(pack_signs(x)))
    world, n = 2, padded_numel(1001, 2)
    on = {}
    for device in ("cpu", "cuda"):
        xs = [t.to(device) for t in rank_inputs(world, n, 5)]
        errs = ([torch.zeros(n, device=device) for _ in range(world)],
                [torch.zeros(n // world, device=device) for _ in range(world)])
        for _ in range(2):  # (more calls: more chances that an ulp flips a sign near 0)
            bufs = [t.clone() for t in xs]
            simulate(bufs, *errs)
        on[device] = [bufs[0], *errs[0], *errs[1]]
    for a, b in zip(on["cpu"], on["cuda"], strict=True):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-5)
