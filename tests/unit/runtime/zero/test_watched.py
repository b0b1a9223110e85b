"""A ZeRO-3 module's watched ``_parameters`` (reads of ungathered parameters reach the
coordinator) is this engine's alone: a copy of the module carries a plain dict."""

from __future__ import annotations

import copy
import pickle

import torch

from deepshard.runtime.zero.stage3 import _WatchedParameters
from deepshard.runtime.zero.status import ZeroParamStatus


class Coordinator:
    def __init__(self):
        self.borrowed = []

    def borrow(self, p):
        self.borrowed.append(p)


def test_a_copied_module_carries_no_watch():
    coordinator = Coordinator()
    m = torch.nn.Linear(2, 2)
    m._parameters = _WatchedParameters(m._parameters, coordinator)
    weight = dict.__getitem__(m._parameters, "weight")
    weight.ds_status = ZeroParamStatus.NOT_AVAILABLE
    assert m.weight is weight and coordinator.borrowed == [weight]
    weight.ds_status = ZeroParamStatus.AVAILABLE
    assert m.weight is weight and coordinator.borrowed == [weight]  # gathered: no call
    for copied in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert type(copied._parameters) is dict
        assert torch.equal(copied.weight, m.weight)
