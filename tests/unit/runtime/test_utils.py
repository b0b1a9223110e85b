"""``deepshard.runtime.utils``: DeepSpeed's common runtime helpers, against DeepSpeed's
behaviour and torch's references."""

from __future__ import annotations

import logging
import math
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from deepshard.runtime.utils import (
    RepeatingLoader,
    clip_grad_norm_,
    get_global_norm,
    see_memory_usage,
    set_random_seed,
)


def test_repeating_loader_starts_the_loader_again_when_it_ends():
    loader = RepeatingLoader([1, 2, 3])
    assert iter(loader) is loader
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]


def test_repeating_loader_reiterates_a_dataloader_so_it_reshuffles():
    torch.manual_seed(0)
    data = DataLoader(list(range(8)), batch_size=8, shuffle=True)
    loader = RepeatingLoader(data)
    epochs = [next(loader).tolist() for _ in range(4)]
    assert all(sorted(e) == list(range(8)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # a fresh iter() each epoch: a new order


def test_repeating_loader_over_nothing_stops():
    with pytest.raises(StopIteration):
        next(RepeatingLoader([]))


def test_set_random_seed_seeds_python_numpy_and_torch():
    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    set_random_seed(1234)
    first = draw()
    set_random_seed(1234)
    assert draw() == first
    set_random_seed(2**70 + 5)  # DeepSpeed reduces large seeds instead of failing
    big = draw()
    set_random_seed(2**70 + 5)
    assert draw() == big != first


def test_see_memory_usage_logs_only_when_forced(caplog):
    with caplog.at_level(logging.INFO, logger="deepshard"):
        see_memory_usage("before the step")
        assert not caplog.records
        see_memory_usage("after the step", force=True)
    (record,) = caplog.records
    assert record.getMessage().startswith("after the step\n")
    assert "CPU Virtual Memory:  used = " in record.getMessage()
    assert "RSS = " in record.getMessage()


def test_get_global_norm_combines_norms_and_flags_invalid_ones():
    assert get_global_norm([3.0, 4.0]) == 5.0
    assert get_global_norm([torch.tensor(3.0), 4]) == 5.0
    assert get_global_norm([]) == 0.0
    for bad in (-1, float("nan"), float("inf")):
        assert get_global_norm([1.0, bad]) == math.inf


@pytest.mark.parametrize("norm_type", [2, 1, math.inf])
def test_clip_grad_norm_matches_torch_in_one_process(norm_type):
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs, strict=True):
        a.grad = torch.randn_like(a) * 3
        b.grad = a.grad.clone()
    got = clip_grad_norm_(ours, max_norm=1.0, norm_type=norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm=1.0, norm_type=norm_type)
    torch.testing.assert_close(got, want.reshape(1), rtol=1e-6, atol=1e-6)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_clip_grad_norm_leaves_small_gradients_alone():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([0.1, 0.2, 0.2])
    norm = clip_grad_norm_(p, max_norm=1.0)
    torch.testing.assert_close(norm, torch.tensor([0.3]))
    torch.testing.assert_close(p.grad, torch.tensor([0.1, 0.2, 0.2]))
