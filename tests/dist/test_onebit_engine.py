"""1-bit Adam through the engine on 2 gloo ranks (``scripts/onebit_engine.py``): the
warm-up is the data-parallel all-reduce and Adam, the compressed phase sends no dense
gradients, every step equals the optimizer driven by hand, and a checkpoint continues
exactly at the same world size and resets the error buffers at another."""

from __future__ import annotations

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "onebit_engine.py")
FREEZE = 2


def test_engine_one_bit_adam_equals_the_optimizer_by_hand_and_resumes(tmp_path):
    result = run_ds("--num_gpus", "2", SCRIPT, str(tmp_path), "train", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == [0, 1]
    for _, r in reports.values():
        assert max(r["diffs"]) < 1e-6, r["diffs"]
        numel = r["numel"]
        # the warm-up all-reduces every gradient (+ the norm); compression: the norm only
        assert all(b >= 4 * numel for b in r["dense_bytes"][:FREEZE]), r["dense_bytes"]
        assert all(b <= 8 for b in r["dense_bytes"][FREEZE:]), r["dense_bytes"]
        # compressed: ~1/32 of fp32 (one bit an element, padding and scales on top)
        assert all(0 < b < 4 * numel / 16 for b in r["optimizer_bytes"][FREEZE:])
        assert r["resumed_diff"] == 0.0
    assert reports[0][1]["diffs"] == reports[1][1]["diffs"]

    one = run_ds("--num_gpus", "1", SCRIPT, str(tmp_path), "resume", timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    (_, r), = tagged_json(one.stdout, "RESULT").values()
    assert r["steps"] == 6 and r["finite"]
    assert "saved by 2 ranks, this job has 1: worker and server errors start from zero" in \
        one.stdout + one.stderr


def test_zero_stage1_one_bit_adam_equals_its_simulation_and_resumes(tmp_path):
    result = run_ds("--num_gpus", "2", SCRIPT, str(tmp_path), "zero1", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == [0, 1]
    for _, r in reports.values():
        assert max(r["diffs"]) < 1e-5, r["diffs"]
        assert r["resumed_diff"] == 0.0
        # shard state (exp_avg, exp_avg_sq) plus the full local momentum and worker error
        assert r["held"] >= 4 * (2 * r["shard"] + 2 * r["padded"]), r


def test_a_small_gpt_trains_as_well_with_the_one_bit_optimizers():
    """Within 5% of the uncompressed optimizer's held-out loss (Adam; LAMB for 1-bit LAMB)
    after 80 steps, 24 of them warm-up, on the same batches."""
    script = str(ROOT / "tests" / "dist" / "scripts" / "onebit_gpt.py")
    result = run_ds("--num_gpus", "2", script, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loss = tagged_json(result.stdout, "RESULT")[0][1]
    for name in ("onebit_adam", "onebit_adam_zero1", "zero_one_adam"):
        assert loss[name] <= 1.05 * loss["adam"], loss
    assert loss["onebit_lamb"] <= 1.05 * loss["lamb"], loss
    assert loss["adam"] < 3.2 and loss["lamb"] < 3.2, loss  # both learned (5.5 at start)
