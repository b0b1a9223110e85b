"""PyTorch-style backward on 2 gloo ranks at ZeRO stages 0-3: ``loss.backward()``,
``out.backward(grad)``, two backwards before one step, accumulation and
``engine.scale(loss).backward()``, the raw module, and losses with weight and gradient
penalties train exactly as ``engine.backward(loss)`` and as one process of plain torch on
the whole batch (``scripts/backward_styles.py``)."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "backward_styles.py")
STYLES = ("engine", "torch", "grad", "twice", "twice_engine", "gas2", "scaled", "raw",
          "penalty")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_backward_style_equals_the_reference(stage):
    result = run_ds("--num_gpus", "2", SCRIPT, str(stage), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == [0, 1]
    for rank, (_, diffs) in reports.items():
        assert set(diffs) - {"rank"} == set(STYLES) - ({"penalty"} if stage == 3 else set())
        for style, diff in diffs.items():
            assert style == "rank" or diff < 1e-5, (rank, style, diffs)
