"""1-bit compression on real gloo ranks (ds-run): the compressed all-reduce equals its
single-process simulation exactly, call after call (the errors carry over), on 2 and 4 ranks,
and sends 1/32 of an fp32 ring all-reduce plus the scales."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "onebit_probe.py")


def results(world: int, *args: str) -> dict[int, dict]:
    result = run_ds("--num_gpus", str(world), SCRIPT, *args, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    found = {rank: data for rank, (_, data) in tagged_json(result.stdout, "RESULT").items()}
    assert sorted(found) == list(range(world))
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_allreduce_matches_its_simulation_on_real_ranks(world):
    for rank, data in results(world, "compressed").items():
        assert data["world"] == world
        assert all(data["same"].values()), (rank, data["same"])
        assert data["errors_nonzero"]["200"] and data["errors_nonzero"]["1000"]
        for size, (padded, sent) in data["bytes"].items():
            assert padded % (8 * world) == 0 and padded - 8 * world < int(size) <= padded
            row = padded // world // 8 + 4  # one chunk's signs and its scale
            assert sent == 2 * (world - 1) * row
            ring_fp32 = 2 * (world - 1) / world * 4 * padded
            assert sent == pytest.approx(ring_fp32 / 32 + 8 * (world - 1))
            # one all-to-all (a row per rank) and one all-gather (its own row) per call
            assert data["counts"]["compressed_allreduce_all_to_all"][str(world * row)] == 4
            assert data["counts"]["compressed_allreduce_all_gather"][str(row)] == 4


def test_onebit_adam_on_two_ranks_equals_its_single_process_simulation():
    found = results(2, "adam")
    for rank, data in found.items():
        assert all(data["same"]), (rank, data["same"])  # exact, every step
        assert data["protocol"] == [False] * 3 + [True] * 5
        padded = -(-data["numel"] // 16) * 16
        row = padded // 2 // 8 + 4
        assert data["sent"] == [0] * 3 + [2 * row] * 5 and data["comm_bytes"] == 10 * row
        # one compressed all-reduce per step for all parameters, not one per parameter
        # (and one for the 1M-parameter step below)
        for op, size in (("all_to_all", 2 * row), ("all_gather", row)):
            counts = data["counts"][f"compressed_allreduce_{op}"]
            assert counts[str(size)] == 5 and sum(counts.values()) == 6
        assert data["errors"]["worker_error"][0] == padded
        assert data["errors"]["server_error"][0] == padded // 2
        assert [data["errors"]["worker_error"][1], data["errors"]["server_error"][1]] == \
            data["ref_errors"]
        assert data["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
        numel, sent = data["big"]  # 1M parameters: 1/32 of the fp32 ring all-reduce
        ring_fp32 = 2 * (2 - 1) / 2 * 4 * numel
        assert sent == pytest.approx(ring_fp32 / 32, rel=1e-3)
    assert found[0]["errors"] != found[1]["errors"]  # the errors are per rank


def test_onebit_adam_converges_like_adam_and_needs_its_error_feedback():
    data = results(2, "converge")[0]
    assert data["onebit"] <= 1.05 * data["adam"], data
    assert data["no_feedback"] > 1.5 * data["onebit"], data
