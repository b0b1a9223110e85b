"""DeepSpeedExamples' AutoTP pattern on 4 gloo ranks (tp 2 x dp 2): the script's own
``mpu=`` next to ``tensor_parallel.autotp_size`` and a client ``torch.optim.AdamW`` built
before AutoTP replaced the Linear layers, against one plain-torch process
(``scripts/autotp_mpu.py``)."""

from __future__ import annotations

import torch

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "autotp_mpu.py")


def test_user_mpu_with_autotp_trains_like_one_process():
    result = run_ds("--num_gpus", "4", SCRIPT, "2", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == [0, 1, 2, 3]
    for _, report in reports.values():
        # the client optimizer steps the sharded replacements of its parameters
        torch.testing.assert_close(report["losses"], report["reference"], rtol=1e-5, atol=0)


def test_user_mpu_whose_groups_autotp_does_not_have_is_one_line():
    result = run_ds("--num_gpus", "4", SCRIPT, "2", "--strided", timeout=240)
    assert result.returncode == 2
    assert "the model-parallel group of mpu= holds ranks" in result.stderr
    assert "Traceback" not in result.stderr
