"""Bucket planning (pure) and the bucket mechanics in one process (world of one)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepshard.errors import UsageError
from deepshard.runtime.buckets import GradBuckets, plan_buckets

F32, F16 = torch.float32, torch.float16


def test_reverse_order_and_capacity():
    shapes = [torch.Size([n]) for n in (4, 4, 4, 10, 2)]
    layouts = plan_buckets(shapes, [F32] * 5, cap_elements=8)
    assert [b.params for b in layouts] == [(4,), (3,), (2, 1), (0,)]
    assert [b.offsets for b in layouts] == [(0,), (0,), (0, 4), (0,)]
    assert [b.numel for b in layouts] == [2, 10, 8, 4]


def test_dtypes_never_share_a_bucket():
    shapes = [torch.Size([3])] * 4
    layouts = plan_buckets(shapes, [F32, F16, F32, F16], cap_elements=100)
    assert {(b.dtype, b.params) for b in layouts} == {(F32, (2, 0)), (F16, (3, 1))}


@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(1, 120))
def test_every_parameter_in_exactly_one_bucket(sizes, cap):
    layouts = plan_buckets([torch.Size([n]) for n in sizes], [F32] * len(sizes), cap)
    members = sorted(i for b in layouts for i in b.params)
    assert members == list(range(len(sizes)))
    for b in layouts:
        assert b.numel == sum(sizes[i] for i in b.params)
        assert b.numel <= cap or len(b.params) == 1


def test_grads_accumulate_into_bucket_views():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = list(model.parameters())
    layouts = plan_buckets([p.shape for p in params], [p.dtype for p in params], 10)
    buckets = GradBuckets(params, layouts, None, 1)
    x = torch.randn(5, 3)

    def backward(sync: bool) -> None:
        buckets.begin_backward(sync)
        model(x).sum().backward()
        buckets.end_backward()

    backward(False)
    first = [p.grad.clone() for p in params]
    backward(False)
    for p, g in zip(params, first, strict=True):
        torch.testing.assert_close(p.grad, 2 * g)
    flat = torch.cat([b.reshape(-1) for b in buckets.buffers])
    assert torch.isclose(flat.sum(), sum(2 * g.sum() for g in first))
    # a user's optimizer.zero_grad() sets grads to None: the next backward refills the views
    for p in params:
        p.grad = None
    backward(True)
    buckets.finish()
    assert all(p.grad.data_ptr() == v.data_ptr() for p, v in zip(params, buckets.views,
                                                                  strict=True))
    buckets.zero()
    assert all(float(b.abs().sum()) == 0.0 for b in buckets.buffers)


def test_misuse_is_a_usage_error_not_wrong_gradients():
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    buckets = GradBuckets(params, plan_buckets([p.shape for p in params],
                                               [p.dtype for p in params], 100),
                          None, 1, names=["weight", "bias"])
    x = torch.randn(4, 3)
    with pytest.raises(UsageError, match=r"(weight|bias) got a gradient outside engine\."):
        model(x).sum().backward()  # a plain loss.backward(): not scaled, not reduced
    # a backward on reduced buffers (two backwards before one step) accumulates, and leaves
    # them to be reduced again
    buckets.zero()
    buckets.begin_backward(True)
    model(x).sum().backward()
    buckets.end_backward()
    buckets.finish()
    assert not buckets.unreduced
    once = [b.clone() for b in buckets.buffers]
    buckets.begin_backward(False)
    model(x).sum().backward()
    buckets.end_backward()
    assert buckets.unreduced
    for b, b1 in zip(buckets.buffers, once, strict=True):
        torch.testing.assert_close(b, 2 * b1)
    buckets.zero()
    buckets.begin_backward(True)
    # a parameter used in two reentrant checkpoints fires its hook twice
    x.requires_grad_()
    loss = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=True).sum() + \
        torch.utils.checkpoint.checkpoint(model, x, use_reentrant=True).sum()
    with pytest.raises(UsageError, match="got its gradient twice in one backward"):
        loss.backward()
