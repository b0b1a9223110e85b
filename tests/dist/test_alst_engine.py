"""ALST's ``sequence_parallel`` switches (tiled MLP, tiled logits + loss, checkpoint
offload) through ``deepshard.initialize`` on 2 gloo ranks train a tiny HF Llama exactly as
without them, at ZeRO stages 0 and 3 (``scripts/alst_engine.py``); the section is validated
with its key paths."""

from __future__ import annotations

import pytest

from deepshard.config import parse_config
from deepshard.errors import UsageError
from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "alst_engine.py")


def test_the_section_is_validated_with_key_paths():
    loaded = parse_config({"train_micro_batch_size_per_gpu": 1, "sequence_parallel": {
        "tiled_mlp_compute": True, "tiled_logits_loss": "true"}})
    options = loaded.config.sequence_parallel
    assert options.tiled_mlp_compute and options.tiled_logits_loss and options.any_enabled()
    assert not parse_config({"train_batch_size": 1}).config.sequence_parallel.any_enabled()
    with pytest.raises(UsageError, match=r"sequence_parallel\.tiled_mlp_shards"):
        parse_config({"train_batch_size": 1, "sequence_parallel": {"tiled_mlp_shards": 0}})
    with pytest.raises(UsageError, match="tiled_mlp_compute"):
        parse_config({"train_batch_size": 1, "sequence_parallel": {"tiled_mlp": True}})


def test_switches_train_as_without_them_at_zero_0_and_3():
    pytest.importorskip("transformers")
    result = run_ds("--num_gpus", "2", SCRIPT, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = tagged_json(result.stdout, "RESULT")
    assert sorted(reports) == [0, 1]
    for _, report in reports.values():
        for stage, diff in report["stages"].items():
            assert diff["moved"], stage
            assert diff["loss"] < 1e-5 and diff["weights"] < 1e-5, (stage, diff)
