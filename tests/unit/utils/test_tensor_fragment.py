"""``deepshard.runtime.tensor_fragment`` ``safe_*`` parameter API: DeepSpeed's answers for a
parameter no engine manages, and for a managed one the calls its strategy
(``param._deepshard_strategy``) gets."""

from __future__ import annotations

import pytest
import torch

from deepshard.errors import UsageError
from deepshard.runtime import tensor_fragment as utils


def test_an_unmanaged_parameter_gets_deepspeeds_answers():
    p = torch.nn.Parameter(torch.ones(3))
    assert utils.safe_get_full_fp32_param(p) is None
    assert utils.safe_get_full_optimizer_state(p, "exp_avg") is None
    assert utils.safe_get_full_grad(p) is None
    utils.safe_set_full_fp32_param(p, torch.zeros(3))  # no effect, no error
    utils.safe_set_full_optimizer_state(p, torch.zeros(3), "exp_avg")
    utils.safe_set_full_grad(p, torch.zeros(3))  # no grad: nothing to copy into
    assert p.grad is None and torch.equal(p.detach(), torch.ones(3))

    p.grad = torch.full((3,), 2.0)
    assert utils.safe_get_full_grad(p) is p.grad
    utils.safe_set_full_grad(p, torch.tensor([1.0, 2.0, 3.0]))
    assert p.grad.tolist() == [1.0, 2.0, 3.0]
    utils.safe_update_full_grad_vectorized([p], lambda g, param: g * 10)
    assert p.grad.tolist() == [10.0, 20.0, 30.0]


@pytest.mark.parametrize("call", [
    lambda p: utils.safe_get_local_fp32_param(p),
    lambda p: utils.safe_get_local_grad(p),
    lambda p: utils.safe_get_local_optimizer_state(p, "exp_avg"),
    lambda p: utils.safe_set_local_fp32_param(p, torch.zeros(1)),
    lambda p: utils.safe_set_local_grad(p, torch.zeros(1)),
    lambda p: utils.safe_set_local_optimizer_state(p, torch.zeros(1), "exp_avg"),
])
def test_the_local_api_needs_a_managed_parameter(call):
    with pytest.raises(UsageError, match="ZeRO-3"):
        call(torch.nn.Parameter(torch.ones(1)))


class RecordingStrategy:
    """Answers every strategy method with a record of the call."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def method(*args):
            self.calls.append((name, *args))
            return f"{name} result"
        return method


def test_a_managed_parameter_is_answered_by_its_strategy():
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)  # the strategy, not .grad, is asked for a managed parameter
    s = p._deepshard_strategy = RecordingStrategy()
    v = torch.zeros(2)
    assert utils.safe_get_full_fp32_param(p) == "full_fp32_param result"
    assert utils.safe_get_full_grad(p) == "full_grad result"
    assert utils.safe_get_full_optimizer_state(p, "exp_avg") == "full_optimizer_state result"
    assert utils.safe_get_local_fp32_param(p) == "local_fp32_param result"
    assert utils.safe_get_local_grad(p) == "local_grad result"
    assert utils.safe_get_local_optimizer_state(p, "exp_avg_sq") == \
        "local_optimizer_state result"
    utils.safe_set_full_fp32_param(p, v)
    utils.safe_set_full_grad(p, v)
    utils.safe_set_full_optimizer_state(p, v, "exp_avg")
    utils.safe_set_local_fp32_param(p, v)
    utils.safe_set_local_grad(p, v)
    utils.safe_set_local_optimizer_state(p, v, "exp_avg")
    assert [c[0] for c in s.calls] == [
        "full_fp32_param", "full_grad", "full_optimizer_state", "local_fp32_param",
        "local_grad", "local_optimizer_state", "set_full_fp32_param", "set_full_grad",
        "set_full_optimizer_state", "set_local_fp32_param", "set_local_grad",
        "set_local_optimizer_state"]
    assert all(c[1] is p for c in s.calls)
    assert s.calls[2][2] == "exp_avg" and s.calls[5][2] == "exp_avg_sq"
    assert s.calls[8][2:] == (v, "exp_avg") and s.calls[11][2:] == (v, "exp_avg")
