"""``deepshard.runtime.tensor_fragment.safe_get_full_*`` (DeepSpeed's tensor-fragment API)
at ZeRO stages 0-3 on 2 gloo ranks: a parameter's whole gradient, fp32 master and optimizer
state equal plain torch's, and so does a step after the ``safe_set_full_*`` (stage 3: the
``safe_set_local_*``) setters changed them (``scripts/fragments_probe.py``)."""

from __future__ import annotations

import pytest
import torch

from deepshard.runtime.tensor_fragment import safe_get_full_fp32_param, safe_get_full_grad
from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "fragments_probe.py")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_fragments_equal_plain_torch(stage):
    result = run_ds("--num_gpus", "2", SCRIPT, str(stage), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == [0, 1]
    # the second step starts from set values of magnitude ~1-3: a few fp32 ulps there
    assert all(r["max_diff"] < 1e-5 for _, r in reports.values()), reports


def test_a_parameter_no_engine_manages_reads_as_in_deepspeed():
    p = torch.nn.Parameter(torch.ones(3))
    assert safe_get_full_fp32_param(p) is None
    p.grad = torch.full((3,), 2.0)
    assert safe_get_full_grad(p) is p.grad
