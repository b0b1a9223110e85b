"""MoE inside pipeline and tensor parallelism, 4 gloo ranks, against one process holding
every expert on the same global batches (fp32: 1e-5).

Pipeline 2 x data 2 (``scripts/moe_parallel.py``): the MoE layer (4 experts, ep 2 over the
data axis, top-2, Adam, ZeRO 0 and 1: the pipeline refuses 2, as DeepSpeed's) on stage 1;
the pipeline carries activations only (DeepSpeed's too), so the aux loss is left out on
both sides. AutoTP 2 x data 2 (``scripts/moe_tp.py``): AutoTP splits the block's MLP and
leaves the MoE layer whole (replicated over the tensor group, its expert-parallel groups
inside each data-parallel group), at ZeRO 0, 1 and 2, with and without a clipping that
clips (the global norm counts every expert once), and a checkpoint saved, loaded and
consolidated at that layout.
"""

from __future__ import annotations

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "moe_parallel.py")
TP_SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "moe_tp.py")
CLIP = 0.05  # moe_tp.py's gradient_clipping


def test_pipeline_with_an_moe_stage_equals_one_process():
    result = run_ds("--num_gpus", "4", SCRIPT, "pp", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == [0, 1, 2, 3]
    for rank, (_, by_stage) in reports.items():
        assert sorted(by_stage["stages"]) == ["s0", "s1"], by_stage
        for label, r in by_stage["stages"].items():
            _check_stage(rank, label, r)


def _check_stage(rank: int, label: str, r: dict) -> None:
    assert len(r["diffs"]) == 2 and max(r["diffs"]) < 1e-5, (rank, label, r)
    experts = [n for n in r["compared"] if ".deepspeed_experts." in n]
    # stage 0 (ranks 0, 1) holds the input layer; stage 1 the gate, 2 local experts, out
    assert len(experts) == (0 if rank < 2 else 8), (rank, r["compared"])
    assert ("out.weight" in r["compared"]) == (rank >= 2)


def test_autotp_with_an_moe_layer_equals_one_process(tmp_path):
    result = run_ds("--num_gpus", "4", TP_SCRIPT, str(tmp_path / "ckpt"), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == [0, 1, 2, 3]
    for rank, (_, r) in reports.items():
        assert sorted(r["cases"]) == [f"ep2-k2-drop-s{s}-adam{c}" for s in (0, 1, 2)
                                      for c in ("", "-clip")], r
        for label, case in r["cases"].items():
            # the dense MLP is split, nothing of the MoE layer is
            assert case["sharded"] == ["blocks.0.fc.bias", "blocks.0.fc.weight",
                                       "blocks.0.proj.weight"], (rank, label, case)
            steps = case["steps"] + case.get("resumed", [])
            for step in steps:
                assert step["diff"] < 1e-5, (rank, label, step)
                assert abs(step["norm"] - step["ref_norm"]) < 1e-5 * step["ref_norm"]
                if label.endswith("-clip"):
                    assert step["ref_norm"] > 2 * CLIP, (rank, label, step)  # it clips
        saved = r["cases"]["ep2-k2-drop-s1-adam-clip"]
        assert saved["loaded"] < 1e-5 and len(saved["resumed"]) == 1, (rank, saved)
        if rank == 0:
            assert saved["consolidated"]["keys"], saved
            assert saved["consolidated"]["diff"] < 1e-5, saved
