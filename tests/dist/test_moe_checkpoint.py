"""MoE checkpoints reshard across expert-parallel sizes (``scripts/moe_checkpoint.py``): a
net with 4 experts (top-2, Adam) trained 3 steps at ep 2 on 4 gloo ranks, saved, resumed
at ep 4 on 4 ranks for 2 steps, saved, resumed at ep 1 on 2 ranks (2 micro-batches each)
for 2 steps: every step's loss and the weights after it equal one plain-torch process
holding every expert on the same global batches (1e-5), so each expert's Adam state
(moments, step) moved with it — at ZeRO stages 2 → 1 → 2 and at stage 0 throughout.
Every checkpoint consolidates (``get_fp32_state_dict_from_zero_checkpoint``) to the
reference's state dict: every expert once, DeepSpeed's key names, in its order (also the
file ``zero_to_fp32`` writes). Between backward and step at every ep size,
``safe_get_full_*`` of each expert parameter return the reference's whole value,
gradient and Adam moments (gathered over the expert's data-parallel group at ZeRO)."""

from __future__ import annotations

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "moe_checkpoint.py")
TOL = 1e-5


def _run(ranks: int, phase: str, root) -> dict[int, dict]:
    result = run_ds("--num_gpus", str(ranks), SCRIPT, phase, str(root), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == list(range(ranks))
    return {rank: data["chains"] for rank, (_, data) in reports.items()}


def _assert_exact(phase: dict, label: str) -> None:
    assert phase["loss"] and max(phase["loss"]) < TOL, (label, phase)
    assert phase["weights"] and max(phase["weights"]) < TOL, (label, phase)
    assert sorted(phase["safe_get"]) == ["exp_avg", "exp_avg_sq", "grad", "param"]
    assert max(phase["safe_get"].values()) < TOL, (label, phase["safe_get"])


def test_ep_2_to_4_to_1_continues_exactly_and_consolidates(tmp_path):
    first = _run(4, "first", tmp_path)
    for rank, chains in first.items():
        assert sorted(chains) == ["s0", "s2"]
        for chain, res in chains.items():
            _assert_exact(res["ep2"], f"{chain} ep2 rank {rank}")
            _assert_exact(res["ep4"], f"{chain} ep4 rank {rank}")
    second = _run(2, "second", tmp_path)
    for rank, chains in second.items():
        for chain, res in chains.items():
            _assert_exact(res["ep1"], f"{chain} ep1 rank {rank}")
    for chain, res in second[0].items():
        assert sorted(res["consolidated"]) == ["ep1", "ep2", "ep4"]
        for tag, got in res["consolidated"].items():
            assert got["keys"], (chain, tag, got["got_keys"])
            assert got["diff"] < TOL, (chain, tag, got)
            experts = [k for k in got["got_keys"] if ".deepspeed_experts." in k]
            assert {k.split(".deepspeed_experts.")[1].split(".")[0] for k in experts} == \
                {"0", "1", "2", "3"}, (chain, tag)
