"""DeepSpeed 0.19.8's checkpoints (``tests/data/deepspeed_checkpoints``: a tiny MLP with a
frozen layer and a buffer, AdamW, WarmupLR, trained 2 steps on 2 ranks at ZeRO 0-3 in fp32
and bf16) load into deepshard at 1, 2 and 4 ranks and at other ZeRO stages
(``scripts/ds_checkpoint_resume.py``): the fp32 weights equal DeepSpeed's at the save,
the counters, schedule and client state come back, and 3 more steps equal DeepSpeed's own
continuation — fp32 within 1e-6; bf16 within 1e-3 (DeepSpeed's bf16 arithmetic differs
from deepshard's in rounding, the loaded state is exact). So do universal checkpoints
(``checkpoint.load_universal``): DeepSpeed's ``ds_to_universal`` output of the ZeRO-2
fixture, and fixtures of stages 0, 2 and 3 converted by deepshard's ``ds_to_universal``
(no ``--inject_missing_state``)."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "ds_checkpoint_resume.py")
CASES = [f"zero{s}_{p}" for s in range(4) for p in ("fp32", "bf16")]
# DeepSpeed's universal folder, and fixtures converted by deepshard's ds_to_universal
UNIVERSAL = ["universal_zero2", "ours:zero0_bf16", "ours:zero2_fp32", "ours:zero3_fp32"]
PLANS = {
    1: [(c, (int(c[4]) + 3) % 4) for c in CASES] + [(u, 3) for u in UNIVERSAL],
    2: [(c, int(c[4])) for c in CASES] + [(u, 0) for u in UNIVERSAL],
    4: [(c, (int(c[4]) + 1) % 4) for c in CASES] + [(u, 1) for u in UNIVERSAL],
}


@pytest.mark.parametrize("ranks", sorted(PLANS))
def test_deepspeed_checkpoints_resume_as_deepspeed_continued(ranks, tmp_path):
    plan = PLANS[ranks]
    args = [a for case, stage in plan for a in (case, str(stage))]
    result = run_ds("--num_gpus", str(ranks), SCRIPT, "resume", str(tmp_path), *args,
                    timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == list(range(ranks))
    for rank, (_, data) in reports.items():
        assert sorted(data["results"]) == sorted(f"{c}@{s}" for c, s in plan)
        for key, got in data["results"].items():
            label = f"{key} rank {rank} of {ranks}"
            assert got["path"] == "global_step2", label
            assert (got["epoch"], got["global_steps"], got["global_samples"]) == (3, 2, 16), \
                (label, got)
            assert got["at_save"] == 0.0, (label, got)
            assert got["lrs"] == pytest.approx(got["want_lrs"], rel=1e-12), (label, got)
            tol = 1e-3 if "bf16" in key else 1e-6
            assert len(got["after"]) == 3 and max(got["after"]) < tol, (label, got)
