"""MoE with expert parallelism through the engine (``scripts/moe_engine.py``) on 2 and 4
gloo ranks: every (ep_size, k, drop_tokens, ZeRO stage 0-2, SGD or Adam; also a client
optimizer with one group over dense and expert parameters, which DeepSpeed 0.19.8 accepts
at stage 0 and asserts on at stages 1-2) case equals one
process holding every expert on the same global batches (fp32: 1e-5), the global gradient
norm counts every expert once (clipping by it), and an expert that no token reaches
(ep 4: a rank with nothing to compute) neither hangs nor drifts."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "moe_engine.py")


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_ep_size_and_stage_equals_one_process_with_every_expert(ranks):
    result = run_ds("--num_gpus", str(ranks), SCRIPT, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == list(range(ranks))
    for _, r in reports.values():
        for label, case in r["cases"].items():
            assert max(case["diffs"]) < 1e-5, (label, case)
            assert max(case["norms"]) < 1e-5, (label, case)
            if "clip" in label:
                assert all(case["clipped"]), (label, case)
            if "empty" in label:
                assert case["counts"][-1] == 0 and min(case["counts"][:-1]) > 0, case
    labels = set(reports[0][1]["cases"])
    assert {label.split("-")[3] for label in labels} == {"s0", "s1", "s2"}
