"""The comms logger records the engine's own collectives, as DeepSpeed's does: 2 gloo
ranks train a 64x64 linear layer 3 steps with ``comms_logger`` on, and log_summary lists
the model broadcast, the gradient reduction of every step and, with ZeRO, the norm's
4-byte all-reduce and the all-gather of the updated shards.

(DeepSpeed 0.19.8 on the same model at ZeRO 1, for comparison: broadcast 256 B and 16 KB
(one per parameter), all_reduce 4 B x3 and 16.25 KB x3, all_gather_into_tensor 8.12 KB x3.)
"""

from __future__ import annotations

import pytest

from deepshard.comm.logger import convert_size
from tests.dist.test_comm import summary_table
from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "comms_engine_probe.py")
MODEL = (64 * 64 + 64) * 4  # fp32 bytes of the layer: one flat gradient bucket
STEPS, WORLD = 3, 2


@pytest.mark.parametrize("stage", [0, 2])
def test_engine_collectives_are_in_the_summary(stage):
    result = run_ds("--num_gpus", str(WORLD), SCRIPT, str(stage), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    want = {"broadcast": {MODEL: 1}, "all_reduce": {MODEL: STEPS}}
    if stage:  # gloo reduces by all-reduce (runtime/zero/comm.py); then the norm, the gather
        want["all_reduce"][4] = STEPS
        want["all_gather_into_tensor"] = {MODEL // WORLD: STEPS}
    results = {rank: data for rank, (_, data) in tagged_json(result.stdout, "RESULT").items()}
    assert sorted(results) == [0, 1]
    for data in results.values():
        assert data["summary"] == {op: {str(size): n for size, n in sizes.items()}
                                   for op, sizes in want.items()}
    assert summary_table(result.stdout) == {
        op: {convert_size(size): n for size, n in sorted(sizes.items())}
        for op, sizes in want.items()}
