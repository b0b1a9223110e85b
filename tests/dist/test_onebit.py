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
