"""LoRA (peft) on a tiny HF Llama at ZeRO-3 with the frozen base partitioned: it trains
exactly like stage 0 also under non-reentrant recompute, two forwards before their
backward and a backward through a retained graph; the base is gathered only while used;
``generate()`` works; checkpoints leave the base out when asked."""

from __future__ import annotations

import json

import pytest

import deepshard
from tests.helpers import ROOT, run_ds

SCRIPT = str(ROOT / "tests" / "integrations" / "scripts" / "peft_zero3.py")
VARIANTS = ("0", "3", "3:recompute", "3:two-forwards", "3:retain", "3:keep")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, object]:
    out = tmp_path_factory.mktemp("peft")
    result = run_ds("--num_gpus", "2", SCRIPT, str(out), *VARIANTS, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    found: dict[tuple[int, int, str], dict] = {}
    for line in result.stdout.splitlines():
        _, _, payload = line.partition(" RESULT ")
        if payload:
            data = json.loads(payload)
            found[(data["rank"], data["stage"], data["mode"])] = data
    assert len(found) == 2 * len(VARIANTS), sorted(found)
    return found, out


@pytest.mark.parametrize("mode", ["plain", "recompute", "two-forwards", "retain", "keep"])
def test_lora_at_stage_3_equals_stage_0(runs, mode):
    found, _ = runs
    for rank in range(2):
        want, got = found[(rank, 0, "plain")], found[(rank, 3, mode)]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), mode
        assert got["generated"] == want["generated"]
        assert want["after_init"]["frozen_whole"] == want["after_init"]["frozen"] == 20


def test_frozen_base_is_partitioned_and_gathered_only_while_used(runs):
    found, _ = runs
    for rank in range(2):
        got = found[(rank, 3, "plain")]
        for facts in (got["after_init"], got["after_steps"]):
            assert facts["frozen_whole"] == 0
            # 1/2 of the base per rank (plus the padding of each flat group)
            assert facts["frozen_bytes_held"] <= facts["frozen_bytes_full"] / 2 + 64
        # the root's embedding and head (registered before and after the layers: two
        # groups) + 2 layers; backward holds the root and one layer at a time
        assert got["frozen_groups"] == 4 and got["max_frozen_live"] == 3
        # kept from forward to backward within stage3_max_reuse_distance
        keep = found[(rank, 3, "keep")]
        assert keep["max_frozen_live"] == 4
        # a forward with grad and no backward: empty_partition_cache releases what it kept
        assert keep["gathered_without_backward"] == 4 and keep["gathered_after_emptying"] == 0
        assert got["gathered_without_backward"] == 0
        whole = found[(rank, 0, "plain")]["state_bytes"]["params"]
        assert got["state_bytes"]["params"] <= whole / 2 + 64


def test_checkpoint_without_the_frozen_base(runs):
    _, out = runs
    state = deepshard.get_fp32_state_dict(out / "3-plain")
    assert state and all("lora_" in name for name in state), sorted(state)[:5]


def test_a_model_partitioned_by_an_earlier_engine_initializes_again():
    """What the Trainer does for evaluate() then train(), or a second train(): a new
    engine over a module that a destroyed stage-3 engine left partitioned."""
    result = run_ds("--num_gpus", "2", str(ROOT / "tests" / "integrations" / "scripts" /
                                          "reinit_probe.py"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    diffs = [json.loads(line.partition(" RESULT ")[2])["diffs"]
             for line in result.stdout.splitlines() if " RESULT " in line]
    assert len(diffs) == 2 and all(d == [0.0] * 4 for d in diffs), diffs
