"""0/1 Adam and 1-bit LAMB on 2 and 4 real gloo ranks (ds-run): every step against the
plain-torch references of DeepSpeed's updates simulating every rank in one process (the
compressed all-reduce by ``simulate``), the engine protocol, the bytes each kind of step
sends, how far 0/1 Adam's ranks drift apart between syncs, and (2 ranks) convergence on a
regression within 5% of Adam's and LAMB's final loss."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "zoadam_onebit_lamb_probe.py")


def results(world: int, *modes: str) -> dict[int, dict]:
    result = run_ds("--num_gpus", str(world), SCRIPT, *modes, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    found = {rank: data for rank, (_, data) in tagged_json(result.stdout, "RESULT").items()}
    assert sorted(found) == list(range(world)), result.stdout[-3000:]
    return found


def check_parity(data: dict, world: int) -> None:
    zo, lamb = data["zoadam"], data["lamb"]
    assert zo["ok"], zo
    # every rank the same after a sync, up to the rounding of p - u; apart between syncs
    assert zo["sync_apart"] < 1e-5 and zo["local_apart"] > 1e-3, zo
    exact = 2 * (world - 1) * zo["numel"] * 4 // world  # a ring all-reduce of fp32
    rows = zo["padded"] // world // 8 + 4  # one chunk's signs and its scale
    assert zo["sent"] == {"variance": exact, "compressed": 2 * (world - 1) * rows,
                          "sync": 2 * (world - 1) * rows, "local": 0}, zo
    # rank 0's checkpoint between syncs, loaded everywhere: local steps, then equal at the sync
    assert [in_sync for in_sync, _ in zo["resumed"]] == [False, False, True, False], zo
    assert zo["resumed"][0][1] > 1e-4 and zo["resumed"][2][1] < 1e-5, zo
    assert lamb["ok"] and lamb["coeffs_ok"], lamb
    assert lamb["protocol"] == [False] * 5 + [True] * 9
    assert lamb["apart"] == 0.0  # the same compressed average on every rank
    assert lamb["sent"] == [0, zo["sent"]["compressed"]]  # same model, same buffer size


def test_two_ranks_match_the_references_and_converge():
    found = results(2, "parity", "converge")
    for data in found.values():
        check_parity(data, 2)
    loss = found[0]["converge"]
    assert all(data["converge"] == loss for data in found.values())
    assert loss["zoadam"] <= 1.05 * loss["adam"], loss
    assert loss["onebit_lamb"] <= 1.05 * loss["lamb"], loss


@pytest.mark.parametrize("world", [4])
def test_four_ranks_match_the_references(world):
    for data in results(world, "parity").values():
        check_parity(data, world)
