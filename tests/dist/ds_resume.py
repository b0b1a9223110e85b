"""Running ``scripts/ds_checkpoint_resume.py resume`` and checking what it reports: the
DeepSpeed-checkpoint tests' shared part."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "ds_checkpoint_resume.py")


def resumed(ranks: int, scratch: Path, plan: list[tuple[str, int]],
            timeout: float = 400) -> dict[int, dict]:
    """Each job of ``plan`` (``(case, ZeRO stage)``) run on ``ranks`` ranks: every rank's
    results by job (``case@stage``), checked to cover every rank and job."""
    args = [a for case, stage in plan for a in (case, str(stage))]
    result = run_ds("--num_gpus", str(ranks), SCRIPT, "resume", str(scratch), *args,
                    timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == list(range(ranks))
    out = {}
    for rank, (_, data) in reports.items():
        assert sorted(data["results"]) == sorted(f"{c}@{s}" for c, s in plan)
        out[rank] = data["results"]
    return out


def check_continued(got: dict, label: str) -> None:
    """One job's report: the save's tag, counters and client state came back, the fp32
    weights equal the record's at the save, and 3 more steps stay within 1e-6 of it (fp32;
    1e-3 bf16) under the same learning rates."""
    assert (got["path"], got["epoch"], got["global_steps"]) == ("global_step2", 3, 2), \
        (label, got)
    assert got["at_save"] == 0.0, (label, got)
    assert got["lrs"] == pytest.approx(got["want_lrs"], rel=1e-12), (label, got)
    tol = 1e-3 if "bf16" in label else 1e-6
    assert len(got["after"]) == 3 and max(got["after"]) < tol, (label, got)
