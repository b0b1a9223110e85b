"""The MoE layer on 2 and 4 gloo ranks (``scripts/moe_layer_probe.py``): at every
expert-parallel size, top-1 and top-2, dropping and dropless, output, input gradient and
parameter gradients equal one process holding all experts over the same per-rank tokens;
experts and ranks that receive no tokens complete; bad sizes are one-line errors."""

from __future__ import annotations

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "moe_layer_probe.py")
TOLERANCE = 1e-5  # fp32, relative to the largest magnitude


def results(world: int, mode: str) -> dict[int, dict]:
    result = run_ds("--num_gpus", str(world), SCRIPT, mode, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    found = {rank: data for rank, (_, data) in tagged_json(result.stdout, "RESULT").items()}
    assert sorted(found) == list(range(world))
    return found


def test_every_ep_size_k_and_drop_mode_equals_one_process_on_four_ranks():
    for data in results(4, "parity").values():
        assert len(data["diffs"]) == 13
        assert all(diff < TOLERANCE for diff in data["diffs"].values()), data["diffs"]


def test_empty_experts_and_bad_sizes_on_two_ranks():
    for data in results(2, "edge").values():
        assert sorted(data["diffs"]) == ["all-to-expert-0", "rank-1-sends-nothing",
                                         "top2-first-expert-0"]
        assert all(diff < TOLERANCE for diff in data["diffs"].values()), data["diffs"]
        assert data["errors"] == [
            "MoE(num_experts=..., ep_size=...): num_experts=3 is not divisible by ep_size=2. "
            "HINT: choose an ep_size that divides num_experts",
            "MoE(ep_size=...): ep_size=4 does not divide the data-parallel size 2. "
            "HINT: choose an ep_size that divides the data-parallel size"]
