"""DeepSpeed-layout and universal checkpoints load into a tensor-parallel job
(``scripts/tp_checkpoint_resume.py``): a tiny GPT trained data parallel and saved in
DeepSpeed's layout, and its universal folder, load into a job whose AutoTP splits every
block (and the embedding and head) over 2 ranks; its gathered weights equal the run's at
the save exactly, and 3 more steps stay within 2e-4 of the run's own continuation: the
two split the sums of a step differently, which AdamW (lr 1e-2) magnifies for gradients
near zero; loading without the optimizer state, the same steps land 0.018-0.05 away."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "tp_checkpoint_resume.py")


@pytest.mark.parametrize("ranks", [2, 4])
def test_checkpoints_load_into_a_tensor_parallel_job(ranks, tmp_path):
    result = run_ds("--num_gpus", str(ranks), SCRIPT, str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == list(range(ranks))
    for rank, (_, data) in reports.items():
        assert sorted(data["results"]) == ["deepspeed", "universal"]
        for kind, got in data["results"].items():
            label = f"{kind} rank {rank} of {ranks}"
            assert "blocks.0.qkv.weight" in got["sliced"] and len(got["sliced"]) >= 12, label
            assert got["global_steps"] == 2, label
            assert got["diffs"][0] == 0.0, (label, got)
            assert len(got["diffs"]) == 4 and max(got["diffs"]) < 2e-4, (label, got)
