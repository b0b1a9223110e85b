"""MoE inside pipeline and tensor parallelism (``scripts/moe_parallel.py``), 4 gloo ranks.

Pipeline 2 x data 2 with the MoE layer (4 experts, ep 2 over the data axis, top-2, Adam,
ZeRO 0 and 1: the pipeline refuses 2, as DeepSpeed's) on stage 1 equals one process
holding every expert (fp32: 1e-5); the pipeline carries activations only (DeepSpeed's
too), so the aux loss is left out on both sides. AutoTP would split the experts' Linears
(dropping their expert marks): the combination is refused in one line naming
``tensor_parallel.autotp_size``.
"""

from __future__ import annotations

import pytest
import torch

from deepshard.errors import UsageError
from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "moe_parallel.py")


def test_pipeline_with_an_moe_stage_equals_one_process():
    result = run_ds("--num_gpus", "4", SCRIPT, "pp", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == [0, 1, 2, 3]
    for rank, (_, by_stage) in reports.items():
        assert sorted(by_stage["stages"]) == ["s0", "s1"], by_stage
        for label, r in by_stage["stages"].items():
            _check_stage(rank, label, r)


def _check_stage(rank: int, label: str, r: dict) -> None:
    assert len(r["diffs"]) == 2 and max(r["diffs"]) < 1e-5, (rank, label, r)
    experts = [n for n in r["compared"] if ".deepspeed_experts." in n]
    # stage 0 (ranks 0, 1) holds the input layer; stage 1 the gate, 2 local experts, out
    assert len(experts) == (0 if rank < 2 else 8), (rank, r["compared"])
    assert ("out.weight" in r["compared"]) == (rank >= 2)


def test_autotp_with_moe_layers_is_refused_in_one_line():
    from deepshard.moe.groups import refuse_tensor_parallel
    from deepshard.moe.layer import MoE

    expert = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), MoE(4, expert, num_experts=2))
    refuse_tensor_parallel(model, 1)
    refuse_tensor_parallel(torch.nn.Linear(4, 4), 2)
    with pytest.raises(UsageError, match="autotp_size=2") as err:
        refuse_tensor_parallel(model, 2)
    assert "\n" not in str(err.value) and "HINT" in str(err.value)
    assert "tensor_parallel.autotp_size" in str(err.value)


def test_initialize_refuses_autotp_with_moe():
    result = run_ds("--num_gpus", "4", SCRIPT, "tp", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == [0, 1, 2, 3]
    for _, r in reports.values():
        assert "tensor_parallel.autotp_size" in r["error"] and "HINT" in r["error"], r
