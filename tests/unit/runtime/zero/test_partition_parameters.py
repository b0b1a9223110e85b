"""``deepshard.runtime.zero.partition_parameters``: DeepSpeed's module path for ``Init``,
``GatheredParameters`` and ``ZeroParamStatus`` (with DeepSpeed's enum values)."""

from __future__ import annotations

import deepshard
from deepshard.runtime.zero import partition_parameters as pp


def test_zero_param_status_has_deepspeeds_members_and_values():
    assert {m.name: m.value for m in pp.ZeroParamStatus} == {
        "AVAILABLE": 1, "NOT_AVAILABLE": 2, "INFLIGHT": 3}


def test_init_and_gathered_parameters_are_deepshard_zeros():
    assert pp.Init is deepshard.zero.Init
    assert pp.GatheredParameters is deepshard.zero.GatheredParameters
