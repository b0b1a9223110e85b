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

from tests.dist.ds_resume import check_continued, resumed

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
    for rank, results in resumed(ranks, tmp_path, PLANS[ranks]).items():
        for key, got in results.items():
            label = f"{key} rank {rank} of {ranks}"
            assert got["global_samples"] == 16, (label, got)
            check_continued(got, label)
