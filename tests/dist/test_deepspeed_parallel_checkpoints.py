"""DeepSpeed 0.19.8's pipeline and MoE checkpoints (``tests/data/deepspeed_checkpoints``:
``pipe2_zero{0,1}``, a 2-stage ``PipelineModule`` on 2 ranks; ``moe_ep2_zero{0,2}``, 4
experts at ``ep_size`` 2 on 2 ranks) load into deepshard jobs (``scripts/
ds_parallel_resume.py``) at the same layout, at other numbers of stages, as plain data
parallelism (an ``nn.Sequential`` of the same layers: DeepSpeed names a pipeline's
parameters by global layer index), at other ``ep_size`` and world sizes and ZeRO stages
(every layer and expert is a file of its own; optimizer state is read by name): the fp32
weights equal DeepSpeed's at the save, the counters, schedule and client state come back,
and 3 more steps equal DeepSpeed's own continuation within 1e-6. With
``load_optimizer_states=False`` the weights load and nothing of the optimizer is needed.
A universal folder made from the pipeline's checkpoint (through a plain data-parallel job
of the same layers) loads into the 2-stage pipeline with ``checkpoint.load_universal``."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "ds_parallel_resume.py")
DATA = ROOT / "tests" / "data" / "deepspeed_checkpoints"
# <case>:<stages or ep_size (pipe: 0 = plain data parallel)>:<ZeRO stage>[:noopt]
PLANS = {
    2: ["pipe2_zero1:2:1", "pipe2_zero1:0:1", "pipe2_zero0:2:0", "pipe2_zero0:1:1",
        "moe_ep2_zero2:2:2", "moe_ep2_zero2:1:0", "moe_ep2_zero0:2:0", "moe_ep2_zero0:1:2",
        "pipe2_zero1:2:0:noopt", "moe_ep2_zero0:2:1:noopt", "pipe2_zero1:2:1:universal"],
    4: ["pipe2_zero1:2:1", "pipe2_zero0:0:0", "moe_ep2_zero2:4:2", "moe_ep2_zero0:2:1"],
}


@pytest.mark.parametrize("ranks", sorted(PLANS))
def test_pipeline_and_moe_checkpoints_resume_as_deepspeed_continued(ranks, tmp_path):
    result = run_ds("--num_gpus", str(ranks), SCRIPT, "--scratch", str(tmp_path),
                    *PLANS[ranks], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == list(range(ranks))
    for job in PLANS[ranks]:
        want = torch.load(DATA / job.split(":")[0] / "expected.pt", weights_only=False)
        seen: set[str] = set()
        for rank, (_, data) in reports.items():
            got = data["results"][job]
            label = f"{job} rank {rank} of {ranks}"
            assert (got["path"], got["epoch"], got["global_steps"]) == \
                ("global_step2", 3, 2), (label, got)
            assert got["at_save"] == 0.0, (label, got)
            steps = 0 if job.endswith(":noopt") else 3
            assert len(got["after"]) == steps and max(got["after"], default=0) < 1e-6, \
                (label, got)
            assert got["lrs"] == pytest.approx(got["want_lrs"][:steps], rel=1e-12), label
            seen.update(got["names"])
        assert seen == set(want["at_save"]), job  # every parameter on some rank
