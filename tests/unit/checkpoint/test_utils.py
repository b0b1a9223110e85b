"""``deepshard.runtime.checkpoint.clone`` (``deepspeed.checkpoint.utils``)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from deepshard.runtime.checkpoint.clone import clone_tensors_for_torch_save
from deepshard.runtime.lr_schedules import SCHEDULERS, VALID_LR_SCHEDULES


def test_clone_tensors_for_torch_save_copies_values_not_storages():
    base = torch.arange(10.0)
    item = OrderedDict(a=base[:2], b=[base[2:4], (base[4:5], 7)], c="x")
    out = clone_tensors_for_torch_save(item)
    assert type(out) is OrderedDict and out["c"] == "x" and out["b"][1][1] == 7
    assert torch.equal(out["a"], base[:2]) and out["a"].untyped_storage().nbytes() == 8
    base.zero_()  # the copies do not share the storage
    assert out["b"][0].tolist() == [2.0, 3.0] and out["b"][1][0].tolist() == [4.0]


def test_valid_lr_schedules_are_deepspeeds_names():
    assert set(SCHEDULERS) <= set(VALID_LR_SCHEDULES)
    assert "LRRangeTest" in VALID_LR_SCHEDULES
